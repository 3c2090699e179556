{{- /* Written by `calmq k8s chart` from calmq/tooling/kubernetes.py; edit that, not this. */}}
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
