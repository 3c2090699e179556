"""The settings that hold a secret (``secretSettings``: read from a Secret's key) or name a
file (``secretFiles``: a Secret's key mounted as a volume), and the refusal of a ``config``
value that carries a secret all the same (``config_secrets``, ``NoSecrets`` and its Go twin
for the chart, ``SECRETS_HELPER``)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from calmq.errors import ConfigError
from calmq.settings import Settings
from calmq.tooling.manifests import Context, Expr, setting_text

CONFIG_NAME = "calmq"  # the ConfigMap, and the Secret the default secretSettings read

SECRET_PLACEHOLDERS = {
    "CALMQ_DATABASE_URL": "postgresql://calmq:CHANGE-ME@postgres:5432/calmq",
    "CALMQ_PROVIDER_API_KEY": "CHANGE-ME",
}

# Who talks to Kafka and to the schema registry: their credentials reach those parts only
# (the migrate Job and the reaper use PostgreSQL alone; the API reads consumer lag for the
# console; only the parts that encode or decode events ask the registry).
KAFKA_PARTS = ("api", "relay", "forwarder", "worker", "batcher", "kafka-setup")
REGISTRY_PARTS = ("relay", "forwarder", "worker", "batcher", "kafka-setup")
# The settings that hold a secret, and the parts that get each (None: every part). Never
# the ConfigMap's: each is read from a Secret's key (``secretSettings``, ``secretKeyRef``),
# by default the Secret ``calmq``'s key ``CALMQ_<NAME>``; an entry without a secretName
# leaves the setting unset.
SECRET_SETTINGS: dict[str, tuple[str, ...] | None] = {
    "database_url": None,
    "provider_api_key": ("worker", "batcher"),
    # The embeddings provider's own key, where it is not the chat provider's (issue 26).
    "embeddings_api_key": ("worker", "batcher"),
    "migrate_database_url": ("migrate",),
    "relay_database_url": ("relay",),
    "direct_database_url": ("api",),  # LISTEN behind a pooler: the API alone
    "kafka_sasl_password": KAFKA_PARTS,
    "kafka_sasl_oauthbearer_client_secret": KAFKA_PARTS,
    "kafka_ssl_key_password": KAFKA_PARTS,
    "schema_registry_password": REGISTRY_PARTS,
    "schema_registry_bearer_token": REGISTRY_PARTS,
}
# The settings that name a file (a CA, a client certificate or key): the file is a Secret's
# key mounted as a volume (``secretFiles``), the setting its path there; by default the
# Secret ``calmq``'s key named here.
SECRET_FILES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kafka_ssl_ca_location": ("kafka-ca.pem", KAFKA_PARTS),
    "kafka_ssl_certificate_location": ("kafka-client.pem", KAFKA_PARTS),
    "kafka_ssl_key_location": ("kafka-client.key", KAFKA_PARTS),
    "schema_registry_ca_location": ("registry-ca.pem", REGISTRY_PARTS),
    "schema_registry_certificate_location": ("registry-client.pem", REGISTRY_PARTS),
    "schema_registry_key_location": ("registry-client.key", REGISTRY_PARTS),
}
# Where a part mounts the file of a secretFiles entry: <root>/<setting, dashed>/<key>.
SECRET_FILES_ROOT = "/etc/calmq/secrets"  # noqa: S105 - a folder, not a password

# Plain settings whose text can carry a secret all the same: a password in a URL's userinfo
# (https://user:password@registry), a credential header among the extra headers, a
# librdkafka password or key in kafka_config. The ConfigMap, and the hook Jobs' inline env,
# are readable by whoever may read ConfigMaps or Jobs (and land in `helm get values`, Argo
# CD's diffs, a GitOps repository): the render refuses such a value, naming the setting
# and where its secret goes instead (``config_secrets``; the chart's calmq.noSecrets
# helper applies the same patterns). Each: (pattern, which settings it applies to, the
# refusal with %s for the setting).
_SECRET_PATTERNS: tuple[tuple[str, str, str], ...] = (
    (r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s]*:[^/?#@\s]*@", "",
     "config.%s holds a password in its URL (user:password@host), which would be written "
     "in the ConfigMap: give the URL without it, and the credentials as secret settings "
     "read from a Secret (schema_registry_username with schema_registry_password; "
     "provider_api_key; a database URL is a secret setting already)"),
    (r'(?i)"[^"]*(authorization|api[-_]?key|token|secret|password|passwd|cookie|credential'
     r'|signature)[^"]*"\s*:', "_extra_headers",
     "config.%s names a credential header, which would be written in the ConfigMap: send "
     "the provider's key as provider_api_key (or embeddings_api_key), read from a Secret, "
     "and keep only plain headers here"),
    (r'(?i)[a-z0-9._-]*(password|secret|key\.pem|oauthbearer\.config|keytab)[a-z0-9._-]*"?'
     r"\s*[:=]", "kafka_config",
     "config.%s sets a librdkafka password, key or secret, which would be written in the "
     "ConfigMap: use the secret settings read from a Secret (kafka_sasl_password, "
     "kafka_ssl_key_password, kafka_sasl_oauthbearer_client_secret, kafka_ssl_key_location "
     "as a secretFiles entry)"),
)


def config_secrets(values: Mapping[str, Any]) -> list[str]:
    """Why each ``config`` value of the values that carries a secret may not be written
    (``_SECRET_PATTERNS``); empty when none does."""
    found = []
    for name, value in sorted((values.get("config") or {}).items()):
        text = setting_text(value)
        for pattern, applies, message in _SECRET_PATTERNS:
            if (not applies or str(name).endswith(applies)) and re.search(pattern, text):
                found.append(message % name)
    return found


@dataclass(frozen=True)
class NoSecrets(Expr):
    """Refuses values whose ``config`` carries a secret (``config_secrets``), with its
    message (Go: the chart's calmq.noSecrets helper, a ``fail``)."""

    def evaluate(self, ctx: Context) -> Any:
        found = config_secrets(ctx.values)
        if found:
            raise ConfigError("; ".join(found), code="secret_in_config")
        return ""

    def go(self) -> str:
        return '(include "calmq.noSecrets" $)'


# The Go twin of config_secrets, for the chart's _helpers.tpl.
SECRETS_HELPER = "".join([
    "{{/* Refuse a config value that carries a secret (calmq/tooling/kubernetes.py:\n",
    "config_secrets): a password in a URL, a credential header, a librdkafka secret. */}}\n",
    '{{- define "calmq.noSecrets" -}}\n',
    "{{- range $name, $value := (.Values.config | default dict) -}}\n",
    '{{- $text := include "calmq.text" $value -}}\n',
    *("{{- if and (or " + json.dumps(not applies) + " (hasSuffix " + json.dumps(applies)
      + " $name)) (regexMatch " + json.dumps(pattern) + " $text) -}}\n"
      "{{- fail (printf " + json.dumps(message) + " $name) -}}\n{{- end -}}\n"
      for pattern, applies, message in _SECRET_PATTERNS),
    "{{- end -}}\n",
    "{{- end -}}\n",
])



_FILE_SETTING = "_location"


def _is_set(settings: Settings, name: str) -> bool:
    value = getattr(settings, name)
    text = value.get_secret_value() if isinstance(value, SecretStr) else value
    return name in settings.model_fields_set and bool(text)


def referenced_secrets(settings: Settings) -> set[str]:
    """The secret settings the pods read from the Secret: those that were set, and those
    the other settings need (a SASL mechanism its password, a registry user its password),
    so that the manifests reference a secret the renderer was never given. The value itself
    never reaches a rendered file."""
    out = {name for name in SECRET_SETTINGS if _is_set(settings, name)}
    if settings.kafka_security_protocol.startswith("SASL_"):
        mechanism = settings.kafka_sasl_mechanism
        if mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            out.add("kafka_sasl_password")
        elif mechanism == "OAUTHBEARER" and settings.kafka_sasl_oauthbearer_method == "oidc":
            out.add("kafka_sasl_oauthbearer_client_secret")
    if settings.schema_registry_username:
        out.add("schema_registry_password")
    return out


def secret_values(settings: Settings) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chart's ``secretSettings`` and ``secretFiles``: an entry per secret setting and
    per file setting, each named after its setting. The database URL and the provider key
    come from the Secret ``calmq`` always; every other entry does when the settings use it
    (``referenced_secrets``; a file setting that was given a path), and is off otherwise
    (an empty secretName), ready to be pointed at a Secret by a values file."""
    used = referenced_secrets(settings) | {"database_url", "provider_api_key"}
    secrets: dict[str, Any] = {}
    for name, parts in SECRET_SETTINGS.items():
        entry: dict[str, Any] = {"secretName": CONFIG_NAME if name in used else "",
                                 "key": f"CALMQ_{name.upper()}"}
        if parts is not None:
            entry["parts"] = list(parts)
        secrets[name] = entry
    files = {name: {"secretName": CONFIG_NAME if getattr(settings, name) else "",
                    "key": key, "parts": list(parts)}
             for name, (key, parts) in SECRET_FILES.items()}
    return secrets, files

