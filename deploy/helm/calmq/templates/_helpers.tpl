{{- /* Written by `calmq k8s chart` from calmq/tooling/kubernetes.py; edit that, not this. */}}
{{/* Every object's name prefix (calmq/tooling/manifests.py: fullname). */}}
{{- define "calmq.fullname" -}}
{{- if .Values.fullnameOverride -}}{{ .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else -}}
{{- $name := default "calmq" .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "calmq.failIf" -}}
{{- if index . 0 -}}{{- fail (index . 1) -}}{{- end -}}
{{- end -}}

{{/* A config value as its CALMQ_ variable spells it (calmq/tooling/manifests.py:
setting_text): YAML numbers arrive as float64, so a whole number drops its fraction. */}}
{{- define "calmq.text" -}}
{{- if kindIs "string" . -}}{{ . }}
{{- else if kindIs "bool" . -}}{{ ternary "true" "false" . }}
{{- else if or (kindIs "map" .) (kindIs "slice" .) -}}{{ toJson . }}
{{- else if kindIs "float64" . -}}
{{- if eq . (float64 (int64 .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else -}}{{ . }}
{{- end -}}
{{- end -}}

{{- define "calmq.image" -}}
{{- if .Values.image.digest -}}{{ printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else -}}{{ printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}
{{- end -}}
{{- end -}}

{{/* What checksum/config hashes: the ConfigMap's data, then secretsVersion. */}}
{{- define "calmq.checksumText" -}}
{{- range $k, $v := .Values.config }}
{{- printf "CALMQ_%s=%s\n" (upper $k) (include "calmq.text" $v) }}
{{- end }}
{{- printf "secretsVersion=%s\n" (toString (default "" .Values.secretsVersion)) }}
{{- end -}}

{{/* KEDA's view of the Kafka security settings (calmq/tooling/keda.py: kafka_auth):
JSON {"metadata": trigger metadata, "spec": TriggerAuthentication spec}. */}}
{{- define "calmq.kedaKafkaAuth" -}}
{{- $config := .Values.config | default dict -}}
{{- $secrets := .Values.secretSettings | default dict -}}
{{- $files := .Values.secretFiles | default dict -}}
{{- $protocol := include "calmq.text" (get $config "kafka_security_protocol") -}}
{{- $mechanism := include "calmq.text" (get $config "kafka_sasl_mechanism") -}}
{{- $meta := dict -}}
{{- $spec := dict -}}
{{- $params := list -}}
{{- $tls := has $protocol (list "SSL" "SASL_SSL") -}}
{{- if $tls -}}{{- $_ := set $meta "tls" "enable" -}}{{- end -}}
{{- $sasl := get (dict "PLAIN" "plaintext" "SCRAM-SHA-256" "scram_sha256" "SCRAM-SHA-512" "scram_sha512" "OAUTHBEARER" "oauthbearer") $mechanism -}}
{{- if and (hasPrefix "SASL_" $protocol) $sasl -}}
{{- $_ := set $meta "sasl" $sasl -}}
{{- if ne $mechanism "OAUTHBEARER" -}}
{{- $params = (list (list "username" "kafka_sasl_username" "config.kafka_sasl_mechanism is set: KEDA's Kafka scaler needs config.kafka_sasl_username") (list "password" "kafka_sasl_password" "config.kafka_sasl_mechanism is set: KEDA's Kafka scaler needs kafka_sasl_password (secretSettings.kafka_sasl_password: the secretName and key of the Secret that holds it)")) -}}
{{- else if eq (include "calmq.text" (get $config "kafka_sasl_oauthbearer_method")) "aws_msk_iam" -}}
{{- $_ := set $meta "saslTokenProvider" "aws_msk_iam" -}}
{{- $_ := set $meta "awsRegion" (required "config.kafka_sasl_oauthbearer_method is aws_msk_iam: KEDA's Kafka scaler needs config.kafka_sasl_oauthbearer_aws_region (its ScaledObject's awsRegion)" (get $config "kafka_sasl_oauthbearer_aws_region")) -}}
{{- $_ := set $spec "podIdentity" (dict "provider" "aws" "identityOwner" "workload") -}}
{{- else -}}
{{- $params = (list (list "username" "kafka_sasl_oauthbearer_client_id" "config.kafka_sasl_mechanism is set: KEDA's Kafka scaler needs config.kafka_sasl_oauthbearer_client_id") (list "password" "kafka_sasl_oauthbearer_client_secret" "config.kafka_sasl_mechanism is set: KEDA's Kafka scaler needs kafka_sasl_oauthbearer_client_secret (secretSettings.kafka_sasl_oauthbearer_client_secret: the secretName and key of the Secret that holds it)") (list "oauthTokenEndpointUri" "kafka_sasl_oauthbearer_token_endpoint_url" "config.kafka_sasl_mechanism is set: KEDA's Kafka scaler needs config.kafka_sasl_oauthbearer_token_endpoint_url") (list "scopes" "kafka_sasl_oauthbearer_scope" "") (list "oauthExtensions" "kafka_sasl_oauthbearer_extensions" "")) -}}
{{- end -}}
{{- end -}}
{{- if $tls -}}{{- $params = concat $params (list (list "ca" "kafka_ssl_ca_location" "") (list "cert" "kafka_ssl_certificate_location" "") (list "key" "kafka_ssl_key_location" "") (list "keyPassword" "kafka_ssl_key_password" "")) -}}{{- end -}}
{{- $refs := list -}}
{{- $env := list -}}
{{- range $params -}}
{{- $file := hasSuffix "_location" (index . 1) -}}
{{- $ref := get $files (index . 1) -}}
{{- if not $file -}}
{{- $secret := get $secrets (index . 1) -}}
{{- if and (kindIs "map" $secret) (dig "secretName" "" $secret) -}}{{- $ref = $secret -}}{{- end -}}
{{- end -}}
{{- if and (kindIs "map" $ref) (dig "secretName" "" $ref) -}}
{{- $refs = append $refs (dict "parameter" (index . 0) "name" $ref.secretName "key" (dig "key" nil $ref)) -}}
{{- else if and (not $file) (include "calmq.text" (get $config (index . 1))) -}}
{{- $env = append $env (dict "parameter" (index . 0) "name" (printf "CALMQ_%s" (upper (index . 1))) "containerName" "worker") -}}
{{- else if index . 2 -}}
{{- fail (index . 2) -}}
{{- end -}}
{{- end -}}
{{- if $refs -}}{{- $_ := set $spec "secretTargetRef" $refs -}}{{- end -}}
{{- if $env -}}{{- $_ := set $spec "env" $env -}}{{- end -}}
{{- toJson (dict "metadata" $meta "spec" $spec) -}}
{{- end -}}
{{/* Refuse a config value that carries a secret (calmq/tooling/kubernetes.py:
config_secrets): a password in a URL, a credential header, a librdkafka secret. */}}
{{- define "calmq.noSecrets" -}}
{{- range $name, $value := (.Values.config | default dict) -}}
{{- $text := include "calmq.text" $value -}}
{{- if and (or true (hasSuffix "" $name)) (regexMatch "^[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\\s]*:[^/?#@\\s]*@" $text) -}}
{{- fail (printf "config.%s holds a password in its URL (user:password@host), which would be written in the ConfigMap: give the URL without it, and the credentials as secret settings read from a Secret (schema_registry_username with schema_registry_password; provider_api_key; a database URL is a secret setting already)" $name) -}}
{{- end -}}
{{- if and (or false (hasSuffix "_extra_headers" $name)) (regexMatch "(?i)\"[^\"]*(authorization|api[-_]?key|token|secret|password|passwd|cookie|credential|signature)[^\"]*\"\\s*:" $text) -}}
{{- fail (printf "config.%s names a credential header, which would be written in the ConfigMap: send the provider's key as provider_api_key (or embeddings_api_key), read from a Secret, and keep only plain headers here" $name) -}}
{{- end -}}
{{- if and (or false (hasSuffix "kafka_config" $name)) (regexMatch "(?i)[a-z0-9._-]*(password|secret|key\\.pem|oauthbearer\\.config|keytab)[a-z0-9._-]*\"?\\s*[:=]" $text) -}}
{{- fail (printf "config.%s sets a librdkafka password, key or secret, which would be written in the ConfigMap: use the secret settings read from a Secret (kafka_sasl_password, kafka_ssl_key_password, kafka_sasl_oauthbearer_client_secret, kafka_ssl_key_location as a secretFiles entry)" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
