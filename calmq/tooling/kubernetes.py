"""Kubernetes manifests for every part of calmq: the one renderer behind `calmq k8s render`,
the Kustomize base in deploy/kubernetes/ and the Helm chart in deploy/helm/calmq.

Two steps, each in one place:

1. **Values** (``default_values``): the chart's values, computed from the settings and the
   registered workflows — the pools, each pool's grace period (its longest step), KEDA's
   lag threshold (the worker's in-flight window) and replica cap (partitions and the token
   budget), the resources measured per part, and ``config``: the settings that were set,
   which the ConfigMap holds (only those: an upgrade's new defaults then arrive).
   ``deploy/helm/calmq/values.yaml`` is this for the default settings.
2. **Manifests** (``DOCS``): every object, described once (calmq/tooling/manifests.py)
   and read two ways: rendered here from the values, and written out as the chart's
   templates (calmq/tooling/chart.py). ``helm template`` and `calmq k8s render` with the
   same values give the same objects (tests/unit/test_chart.py).

What is rendered (docs/how-to/deploy-kubernetes.md says how to apply it): the ConfigMap
``calmq`` (every container takes it with ``envFrom``, so no part can miss a setting the
others have), the settings read from Secrets (``secretSettings``: ``secretKeyRef`` by
setting, so a database operator's Secret is used as it is; ``secretFiles``: a CA, a client
certificate or key, or any secret kept out of the environment, mounted from a Secret's
key), the migration and Kafka setup Jobs as pre-install/pre-upgrade hooks (Helm and Argo
CD; they carry their settings inline, so they run before anything else exists), the API
(Deployment, Service, PDB), the relay (one replica, ``Recreate``), the retry forwarder, the
reaper, per pool the workers with their KEDA ScaledObject (and, for a Kafka that wants TLS
or SASL, its TriggerAuthentication from the same Secret keys: calmq/tooling/keda.py) and
the batcher, and, each behind a value, PodMonitors, the
PrometheusRule, the Grafana dashboard, NetworkPolicies, the Namespace (PodSecurity
``restricted``) and the ServiceAccount.

Every pod sets ``enableServiceLinks: false``: a Service named ``calmq-*`` would otherwise
inject ``CALMQ_*_PORT=tcp://...`` variables that look like settings.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from calmq.errors import ConfigError
from calmq.settings import Settings
from calmq.tooling import keda
from calmq.tooling.manifests import (
    Above,
    And,
    Check,
    Checksum,
    Context,
    Dashed,
    Default,
    Doc,
    Each,
    Entries,
    Expr,
    Fail,
    FileText,
    FullName,
    Has,
    Image,
    Key,
    Namespace,
    Not,
    Or,
    Printf,
    Release,
    Required,
    Served,
    Spread,
    Text,
    Upper,
    Val,
    When,
    Without,
    documents,
    merge_values,
    setting_text,
)
from calmq.workflows import Workflow, load_workflows

__all__ = [
    "CONFIG_NAME",
    "DOCS",
    "DRAIN_SECONDS",
    "METRICS_PORT",
    "chart_files",
    "default_values",
    "dump",
    "dump_all",
    "kustomization",
    "load_settings",
    "load_values",
    "longest_step",
    "render",
    "secret_template",
    "write",
]

CONFIG_NAME = "calmq"  # the ConfigMap, and the Secret the default secretSettings read
API_PORT = 8080
METRICS_PORT = 9100
# After the grace period a worker still commits its offsets, leaves the group and closes
# its pools; measured well under 5 s, so 15 s is ample before the kubelet's SIGKILL.
DRAIN_SECONDS = 15
PARTS = ("api", "relay", "forwarder", "reaper", "worker", "batcher", "migrate",
         "kafka-setup")

# Settings that are not the ConfigMap's: secrets and URLs of the local stack, each part's
# own (set in its container), and the renderer's inputs.
_PER_PART = frozenset({"pool", "priorities", "concurrency", "worker_id", "api_host",
                       "api_port", "api_metrics_port", "api_console", "api_console_port",
                       "grace_seconds"})
_NOT_IN_CLUSTER = frozenset({"api_url", "fake_provider_url"})
_RENDER_ONLY = frozenset({"image", "image_pull_policy", "image_pull_secrets"})
_RENDER_ONLY_PREFIX = "keda_"

# Where the in-cluster services are when the settings leave them empty (the names of
# docker-compose.kafka.yml's services, which a cluster usually mirrors).
PLACEHOLDERS = {
    "kafka_bootstrap": "kafka:9092",
    "schema_registry_url": "http://schema-registry:8080/apis/ccompat/v7",
    "object_store_url": "s3://calmq/objects",
}
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


@dataclass(frozen=True)
class Resources:
    """Requests and limits of one container, from the figures measured in
    docs/how-to/deploy-kubernetes.md (peak RSS and CPU of each part under load)."""

    cpu_request: str
    memory_request: str
    cpu_limit: str
    memory_limit: str
    storage_request: str = "16Mi"
    storage_limit: str = "64Mi"

    def manifest(self) -> dict[str, dict[str, str]]:
        return {"requests": {"cpu": self.cpu_request, "memory": self.memory_request,
                             "ephemeral-storage": self.storage_request},
                "limits": {"cpu": self.cpu_limit, "memory": self.memory_limit,
                           "ephemeral-storage": self.storage_limit}}


# Measured (docs/how-to/deploy-kubernetes.md): peak RSS api 68 MiB, relay 82-89, worker
# 99-122 (concurrency 256, 1,170 jobs/s), forwarder 71, reaper 61; CPU at 1,170 jobs/s api
# 0.23 core, relay 0.14, worker 0.5. Memory requests sit above the measured peak, limits at
# about twice it (larger payloads, a busier heap); CPU requests near the steady state at
# moderate load, limits at one core or less. The API's limit also holds ten 100 MiB uploads
# streaming to S3 at once, one multipart part (8 MiB) each in memory and nothing on disk
# (measured: docs/how-to/deploy-kubernetes.md).
RESOURCES: dict[str, Resources] = {
    "api": Resources("100m", "128Mi", "1", "384Mi"),
    "relay": Resources("50m", "128Mi", "1", "256Mi"),
    "worker": Resources("200m", "160Mi", "1", "384Mi"),
    "forwarder": Resources("20m", "96Mi", "500m", "192Mi"),
    "reaper": Resources("10m", "80Mi", "250m", "160Mi"),
    # Not measured yet: a pack holds its requests' bytes (up to CALMQ_BATCH_MAX_BYTES) and
    # one waiting attempt per job; collecting streams results in 64 KiB reads.
    "batcher": Resources("50m", "256Mi", "1", "768Mi"),
    "jobs": Resources("50m", "96Mi", "500m", "256Mi"),
}


# -- settings and values -------------------------------------------------------------------


def load_settings(path: Path | None, environ: Mapping[str, str],
                  flags: Mapping[str, Any] | None = None) -> Settings:
    """Settings from a settings file (YAML ``setting: value``), then ``CALMQ_*`` variables,
    then flags: each one wins over the one before. Unknown names are an error everywhere."""
    import yaml

    values: dict[str, str] = {}
    if path is not None:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of setting names to values")
        for name, value in raw.items():
            text = json.dumps(value) if isinstance(value, (dict, list)) else (
                str(value).lower() if isinstance(value, bool) else str(value))
            values["CALMQ_" + str(name).upper()] = text
    values.update({k: v for k, v in environ.items() if k.startswith("CALMQ_")})
    return Settings.load(flags, environ=values)


def load_values(path: Path) -> dict[str, Any]:
    """A chart values file (what ``helm -f`` takes), checked to be one."""
    import yaml

    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of chart values", code="invalid_values")
    # `image` is a value too (a map), and a setting (a reference): only the map is a value.
    settings = sorted(set(raw) & set(Settings.model_fields) - {"image"})
    if isinstance(raw.get("image"), str):
        settings.append("image")
    if settings:
        raise ConfigError(
            f"{path} names settings at its top ({', '.join(settings)}): a values file holds "
            "them under config: (or pass a settings file with --settings)",
            code="invalid_values")
    return raw


def _plain(value: Any) -> Any:
    """A setting's value as the chart's ``config`` holds it (YAML's own types)."""
    if isinstance(value, dict):
        return {k: v.model_dump(exclude_none=True) if hasattr(v, "model_dump") else v
                for k, v in sorted(value.items())}
    return value


def config_values(settings: Settings) -> dict[str, Any]:
    """The chart's ``config``: the settings that were set (a file, a variable, a flag), and
    the in-cluster addresses of Kafka, the registry and the object store when unset. Not
    every default: a default frozen in a ConfigMap would outlive the release that chose
    it, and a setting a release renames would stop the pods of the next one."""
    out: dict[str, Any] = {}
    for name in sorted(settings.model_fields_set):
        if (name in _PER_PART or name in _NOT_IN_CLUSTER or name in _RENDER_ONLY
                or name in SECRET_SETTINGS or name in SECRET_FILES
                or name.startswith(_RENDER_ONLY_PREFIX)):
            continue
        value = getattr(settings, name)
        if value is None or isinstance(value, SecretStr):
            continue
        out[name] = _plain(value)
    for name, placeholder in PLACEHOLDERS.items():
        if not out.get(name):
            out[name] = placeholder
    return dict(sorted(out.items()))


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


def longest_step(settings: Settings, workflows: Mapping[str, Workflow], pool: str) -> float:
    """The longest step timeout of the steps routed to ``pool`` (the override wins)."""
    if settings.step_timeout_seconds is not None:
        return settings.step_timeout_seconds
    timeouts = [step.timeout_seconds for wf in workflows.values() for step in wf.steps
                if (step.pool or wf.pool) == pool]
    return max(timeouts, default=60.0)  # a pool no registered workflow names: Step's default


def _part(resources: Resources, **extra: Any) -> dict[str, Any]:
    """The values every part has: resources and scheduling, service account, extra
    labels, annotations and environment."""
    return {
        **extra,
        "resources": resources.manifest(),
        "nodeSelector": {},
        "tolerations": [],
        "affinity": {},
        "topologySpreadConstraints": [],
        "priorityClassName": "",
        "serviceAccountName": "",  # empty: serviceAccount.name (Jobs: the namespace's)
        "labels": {},
        "annotations": {},
        "podLabels": {},
        "podAnnotations": {},
        "extraEnv": [],
        "tmpSizeLimit": "64Mi",  # the emptyDir at /tmp, the one writable place
        "extraVolumes": [],
        "extraVolumeMounts": [],
        "initContainers": [],
        "sidecars": [],
    }


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def _pool_values(settings: Settings, grace_seconds: float) -> dict[str, Any]:
    grace = max(settings.grace_seconds, grace_seconds)
    return {
        "priorities": settings.priorities,
        "concurrency": settings.concurrency,
        # The worker's own grace covers the pool's longest step; the pod's adds the drain.
        "graceSeconds": _number(grace),
        "terminationGracePeriodSeconds": math.ceil(grace) + DRAIN_SECONDS,
        "replicas": 1,  # only without KEDA: with it, KEDA owns the count
        "keda": keda.pool_scaling(settings),
        "pdb": {"enabled": False, "maxUnavailable": 1},
        "batcher": {"enabled": True, "replicas": 1,
                    "terminationGracePeriodSeconds": max(30, math.ceil(settings.grace_seconds)),
                    **_part(RESOURCES["batcher"])},
        **_part(RESOURCES["worker"]),
    }


def _difference(value: Any, base: Any) -> Any:
    """What ``value`` sets that ``base`` does not (maps key by key)."""
    if isinstance(value, dict) and isinstance(base, dict):
        out = {k: _difference(v, base.get(k)) for k, v in value.items()
               if k not in base or v != base[k]}
        return {k: v for k, v in out.items() if v != {}}
    return value


def _image(reference: str) -> dict[str, str]:
    name, _, digest = reference.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    else:
        tag = "latest"
    return {"repository": name, "tag": tag, "digest": digest}


def default_values(settings: Settings, workflows: Mapping[str, Workflow] | None = None
                   ) -> dict[str, Any]:
    """The chart's values for these settings (module docstring, step 1)."""
    registry = dict(workflows) if workflows is not None else load_workflows(settings)
    names = keda.pools(settings, registry)
    defaults = _pool_values(settings, 60.0)
    secrets, files = secret_values(settings)
    pools = {name: _difference(_pool_values(settings, longest_step(settings, registry, name)),
                               defaults) for name in names}
    return {
        "nameOverride": "",
        "fullnameOverride": "",
        "image": {**_image(settings.image), "pullPolicy": settings.image_pull_policy},
        "imagePullSecrets": [{"name": n.strip()} for n in settings.image_pull_secrets.split(",")
                             if n.strip()],
        "namespace": {"create": False, "podSecurity": "restricted", "labels": {}},
        "commonLabels": {},
        # APIs to take as served where Helm cannot ask the cluster (helm lint).
        "apiVersions": [],
        "openshift": False,
        # The image's user (Dockerfile: uid 10001); the root filesystem is read-only and
        # the only writable place is /tmp. PodSecurity "restricted" admits these pods.
        "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                               "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
        "containerSecurityContext": {"allowPrivilegeEscalation": False,
                                     "readOnlyRootFilesystem": True,
                                     "capabilities": {"drop": ["ALL"]}},
        "topologySpread": {"enabled": True, "maxSkew": 1,
                           "topologyKey": "kubernetes.io/hostname"},
        "strictSettings": False,
        "config": config_values(settings),
        "secretsVersion": "",
        "secretSettings": secrets,
        "secretFiles": files,
        "extraEnv": [],
        "serviceAccount": {"create": True, "name": "", "annotations": {}},
        "scrapeAnnotations": True,
        "api": {
            "replicas": 2,
            "port": API_PORT,
            "metricsPort": settings.api_metrics_port or METRICS_PORT,
            "console": {"enabled": settings.api_console,
                        "port": settings.api_console_port or 0},
            # The API drains open requests and SSE streams within aiohttp's shutdown
            # timeout (60 s), after the preStop pause that lets the Service's endpoints
            # drop the pod before it stops accepting.
            "terminationGracePeriodSeconds": 75,
            "preStopSeconds": 5,
            "service": {"type": "ClusterIP", "port": API_PORT, "annotations": {}},
            # Rendered only above one replica: at one, minAvailable 1 blocks every drain.
            "pdb": {"enabled": True, "minAvailable": 1},
            "ingress": {"enabled": False, "className": "", "host": "", "path": "/",
                        "annotations": {}, "tls": [],
                        # ingress-nginx's annotations for the upload size and the SSE
                        # and Prefer: wait timeouts (others: set annotations yourself).
                        "nginx": True, "bodySize": _body_size(settings),
                        "timeoutSeconds": _stream_seconds(settings)},
            "httpRoute": {"enabled": False, "parentRefs": [], "hostnames": [],
                          "annotations": {},
                          "timeoutSeconds": _stream_seconds(settings)},
            **_part(RESOURCES["api"]),
        },
        "relay": {"terminationGracePeriodSeconds": 30, **_part(RESOURCES["relay"])},
        "forwarder": {"replicas": 1, "terminationGracePeriodSeconds": 30,
                      **_part(RESOURCES["forwarder"])},
        "reaper": {"replicas": 1, "terminationGracePeriodSeconds": 15,
                   **_part(RESOURCES["reaper"])},
        "jobs": {"backoffLimit": 4, "ttlSecondsAfterFinished": 86400,
                 "migrate": {"hook": True}, "kafkaSetup": {"hook": True},
                 **_part(RESOURCES["jobs"])},
        "tests": {"enabled": True},
        "workers": {"poolDefaults": defaults, "pools": pools},
        "monitoring": {
            "podMonitor": {"enabled": False, "labels": {}, "interval": "30s"},
            "prometheusRule": {"enabled": False, "labels": {}, "runbookBaseUrl": ""},
            "dashboard": {"enabled": False, "labels": {"grafana_dashboard": "1"},
                          "annotations": {}},
        },
        "networkPolicy": {"enabled": False, "apiFrom": [], "metricsFrom": [],
                          "consoleFrom": []},
        "extraObjects": [],
    }


def _body_size(settings: Settings) -> str:
    """An upload's largest body: the file (max_upload_bytes) and the form around it."""
    return f"{math.ceil(settings.max_upload_bytes / 2**20) + 1}m"


def _stream_seconds(settings: Settings) -> int:
    """How long a proxy keeps a response open: an SSE stream's hour, and never less than
    the longest Prefer: wait."""
    return max(3600, math.ceil(settings.api_prefer_wait_max_seconds))


# -- the objects ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """Where a part's values are: under ``root`` of the values, or of the pool entry."""

    name: str  # the component: api, relay, worker, ...
    root: tuple[str, ...]
    scope: str = "root"

    def __call__(self, *path: str, block: bool = False) -> Val:
        return Val((*self.root, *path), self.scope, block)


def _root(*path: str, block: bool = False) -> Val:
    return Val(path, block=block)


@dataclass(frozen=True)
class AppVersion(Expr):
    """calmq's version, the chart's appVersion (the recommended version label)."""

    def evaluate(self, ctx: Context) -> Any:
        from calmq import __version__

        return __version__

    def go(self) -> str:
        return "$.Chart.AppVersion"


# The name label: the chart's name, or nameOverride.
_NAME = Default(Val(("nameOverride",)), "calmq")


def _named(suffix: str, *args: Any) -> Printf:
    """An object's name: the release's prefix (``FullName``), then ``suffix``."""
    return Printf("%s-" + suffix, FullName(), *args)


def _selector(component: str, pool: Any = None) -> dict[str, Any]:
    """The labels a part's pods are selected by: the release's (instance) among them, so
    two releases in one namespace never select each other's pods."""
    labels: dict[str, Any] = {"app.kubernetes.io/name": _NAME,
                              "app.kubernetes.io/instance": Release(),
                              "app.kubernetes.io/component": component}
    if pool is not None:
        labels["calmq.dev/pool"] = pool
    return labels


def _labels(component: str, pool: Any = None) -> dict[Any, Any]:
    """An object's labels: the selector's, the part-of and the scrape job name that both
    Prometheus discovery styles read (the PodMonitor's jobLabel; the pod relabelling of
    docs/how-to/alerting.md)."""
    labels: dict[Any, Any] = {**_selector(component, pool), "app.kubernetes.io/part-of": "calmq",
                              "app.kubernetes.io/version": AppVersion()}
    if component in PARTS:
        labels["calmq.dev/job"] = f"calmq-{component}"
    labels[Spread(_root("commonLabels"))] = None
    return labels


def _meta(name: Any, component: str, part: _Part | None = None, *, pool: Any = None,
          annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    labels = _labels(component, pool)
    meta: dict[str, Any] = {"name": name, "namespace": Namespace(), "labels": labels}
    if part is not None:
        labels[Spread(part("labels"))] = None
        if annotations:
            meta["annotations"] = {**annotations, Spread(part("annotations")): None}
        else:
            meta["annotations"] = When(part("annotations"), part("annotations", block=True))
    elif annotations:
        meta["annotations"] = annotations
    return meta


def _when_set(value: Val, *, block: bool = False) -> When:
    return When(value, Val(value.path, value.scope, block))


def _for_part(scope: str, part: str) -> And:
    """An entry of ``secretSettings`` or ``secretFiles`` (bound to ``scope``) this part
    gets: it names a Secret, and names this part among its ``parts`` (or none: all)."""
    def ref(*path: str) -> Val:
        return Val(path, scope)

    return And((ref("secretName"), Or((Not(ref("parts")), Has(ref("parts"), part)))))


def _secret_env(part: str) -> Each:
    """The settings read from Secrets: every ``secretSettings`` entry with a Secret that
    names this part (or no part: all of them)."""
    def ref(*path: str) -> Val:
        return Val(path, "secret")

    return Each(
        _root("secretSettings"), "secret",
        {"name": Printf("CALMQ_%s", Upper(Key("secret"))),
         "valueFrom": {"secretKeyRef": {"name": ref("secretName"), "key": ref("key")}}},
        where=_for_part("secret", part))


def _file_dir() -> Printf:
    return Printf(f"{SECRET_FILES_ROOT}/%s", Dashed(Key("file")))


@dataclass(frozen=True)
class _FileVariable(Expr):
    """The variable a ``secretFiles`` entry sets to its file's path: ``CALMQ_<NAME>`` for a
    setting that names a file (``*_location``), ``CALMQ_<NAME>_FILE`` for any other (calmq
    reads the setting from the file, so its value never enters the environment)."""

    of: Key

    def evaluate(self, ctx: Context) -> Any:
        name = str(self.of.evaluate(ctx))
        return f"CALMQ_{name.upper()}" + ("" if name.endswith(_FILE_SETTING) else "_FILE")

    def go(self) -> str:
        of = self.of.go()
        return (f'(printf "CALMQ_%s%s" (upper {of}) '
                f'(ternary "" "_FILE" (hasSuffix "{_FILE_SETTING}" {of})))')


_FILE_SETTING = "_location"


def _file_env(part: str) -> Each:
    """The settings whose file is a Secret's key (``secretFiles``): the file's path where
    the part mounts it (``_file_mount``), as the setting or as its ``_FILE`` variable."""
    return Each(
        _root("secretFiles"), "file",
        {"name": _FileVariable(Key("file")),
         "value": Printf("%s/%s", _file_dir(), Val(("key",), "file"))},
        where=_for_part("file", part))


def _file_mount(part: str) -> Each:
    return Each(_root("secretFiles"), "file",
                {"name": Dashed(Key("file")), "mountPath": _file_dir(), "readOnly": True},
                where=_for_part("file", part))


def _file_volume(part: str) -> Each:
    """The Secret volume of a ``secretFiles`` entry: its one key, readable by the pod's
    group (fsGroup, the image's user) and no one else."""
    key = Val(("key",), "file")
    return Each(_root("secretFiles"), "file",
                {"name": Dashed(Key("file")),
                 "secret": {"secretName": Val(("secretName",), "file"),
                            "items": [{"key": key, "path": key}],
                            "defaultMode": 0o440}},
                where=_for_part("file", part))


def _config_env() -> Each:
    """The ConfigMap's entries as the container's own env (the Jobs: they run as hooks,
    before the ConfigMap exists)."""
    return Each(_root("config"), "cfg",
                {"name": Printf("CALMQ_%s", Upper(Key("cfg"))), "value": Text(Val((), "cfg"))})


def _probe(path: str, port: str, *, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": 2, "failureThreshold": failures}


def _container(name: Any, args: list[Any], part: _Part, *,
               env: Sequence[Any] = (), ports: Sequence[Any] = (),
               probes: tuple[str, str, str] | None = None, inline_config: bool = False,
               lifecycle: dict[str, Any] | None = None) -> dict[str, Any]:
    """One calmq container: ``calmq <args>``, every setting from the ConfigMap (Jobs: the
    same entries inline) and the Secrets. ``probes``: (port, liveness path, readiness
    path); the parts without an HTTP API are probed on their metrics port: /livez fails
    once the part's event loop stops turning (calmq/heartbeat.py), /metrics answers while
    the process runs."""
    container: dict[str, Any] = {
        "name": name,
        "image": Image(),
        "imagePullPolicy": _root("image", "pullPolicy"),
        "command": ["calmq"],
        "args": args,
    }
    if not inline_config:
        container["envFrom"] = [{"configMapRef": {"name": FullName()}}]
    # env wins over envFrom: a Deployment's own settings (its pool) over the shared ones.
    container["env"] = [
        # The ConfigMap may name a setting this image does not know (an upgrade's or a
        # rollback's skew): a warning in the log, not a crash loop.
        {"name": "CALMQ_STRICT_SETTINGS", "value": Text(_root("strictSettings"))},
        *([_config_env()] if inline_config else []),
        *env,
        _secret_env(part.name),
        _file_env(part.name),
        Spread(_root("extraEnv")),
        Spread(part("extraEnv")),
    ]
    if ports:
        container["ports"] = list(ports)
    if probes is not None:
        port, live, ready = probes
        container["startupProbe"] = _probe(ready, port, period=2, failures=30)
        container["livenessProbe"] = _probe(live, port, period=10, failures=3)
        container["readinessProbe"] = _probe(ready, port, period=5, failures=2)
    if lifecycle is not None:
        container["lifecycle"] = lifecycle
    container["resources"] = part("resources", block=True)
    # openshift: the restricted SCC assigns the UID and GID; a fixed one is refused.
    container["securityContext"] = Without(_root("containerSecurityContext"), _IDS,
                                           _root("openshift"))
    container["volumeMounts"] = [{"name": "tmp", "mountPath": "/tmp"},  # noqa: S108
                                 _file_mount(part.name), Spread(part("extraVolumeMounts"))]
    return container


def _spread(selector: dict[str, Any] | None, part: _Part) -> Any:
    """Soft topology spread (``topologySpread``: ScheduleAnyway, so a small cluster still
    schedules every replica) over the part's own pods, and the part's own constraints."""
    own = part("topologySpreadConstraints")
    if selector is None:
        return _when_set(own, block=True)
    spread = ("topologySpread",)
    on = _root(*spread, "enabled")
    soft = {"maxSkew": _root(*spread, "maxSkew"), "topologyKey": _root(*spread, "topologyKey"),
            "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": selector}}
    return When(Or((on, own)), [When(on, soft), Spread(own)])


def _pod(part: _Part, containers: list[Any], *, grace: Any, restart: str = "Always",
         service_account: Any = None, component: str | None = None) -> dict[str, Any]:
    account = service_account if service_account is not None else Default(
        part("serviceAccountName"),
        And((_root("serviceAccount", "create"),
             Default(_root("serviceAccount", "name"), FullName()))))
    return {
        # Service links would inject CALMQ_<SERVICE>_PORT=tcp://... for a Service named
        # calmq-*; calmq tolerates them, but they are noise and shadow real settings.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # calmq never calls the Kubernetes API
        "serviceAccountName": When(account, account),
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": grace,
        # The image's user (Dockerfile: uid 10001); the root filesystem is read-only and
        # the only writable place is /tmp. PodSecurity "restricted" admits this pod.
        # openshift: without runAsUser, runAsGroup and fsGroup, which the SCC assigns.
        "securityContext": Without(_root("podSecurityContext"), _IDS, _root("openshift")),
        "imagePullSecrets": _when_set(_root("imagePullSecrets"), block=True),
        "priorityClassName": _when_set(part("priorityClassName")),
        "nodeSelector": _when_set(part("nodeSelector"), block=True),
        "tolerations": _when_set(part("tolerations"), block=True),
        "affinity": _when_set(part("affinity"), block=True),
        "topologySpreadConstraints": _spread(None, part),
        "initContainers": _when_set(part("initContainers"), block=True),
        "containers": [*containers, Spread(part("sidecars"))],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": part("tmpSizeLimit")}},
                    _file_volume(component or part.name), Spread(part("extraVolumes"))],
    }


_IDS = ("runAsUser", "runAsGroup", "fsGroup")


def _template_meta(part: _Part, component: str, pool: Any = None) -> dict[str, Any]:
    return {
        "labels": {**_labels(component, pool), Spread(part("podLabels")): None},
        "annotations": {
            # The ConfigMap's data and secretsVersion: a change rolls the pods.
            "checksum/config": Checksum(),
            "prometheus.io/scrape": When(_root("scrapeAnnotations"), "true"),
            "prometheus.io/port": When(_root("scrapeAnnotations"), str(METRICS_PORT)),
            "prometheus.io/path": When(_root("scrapeAnnotations"), "/metrics"),
            Spread(part("podAnnotations")): None,
        },
    }


def _deployment(name: Any, component: str, part: _Part, pod: dict[str, Any], *,
                replicas: Any, strategy: str = "RollingUpdate", pool: Any = None
                ) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if replicas is not None:
        spec["replicas"] = replicas
    # A Deployment's replicas spread over their own selector (a Job runs one pod).
    pod = {**pod, "topologySpreadConstraints": _spread(_selector(component, pool), part)}
    spec.update({
        "selector": {"matchLabels": _selector(component, pool)},
        "strategy": {"type": strategy},
        "template": {"metadata": _template_meta(part, component, pool), "spec": pod},
    })
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(name, component, part, pool=pool), "spec": spec}


def _metrics_part(component: str, part: _Part, args: list[Any], *, pool: Any = None,
                  env: Sequence[Any] = ()) -> dict[str, Any]:
    return _container(component, [*args, "--metrics-port", str(METRICS_PORT)], part, env=env,
                      ports=[{"name": "metrics", "containerPort": METRICS_PORT}],
                      probes=("metrics", "/livez", "/metrics"))


def _hooks(weight: int) -> dict[str, str]:
    """A Job that runs before the release's other objects change, and again with each
    upgrade: a Helm pre-install/pre-upgrade hook and an Argo CD PreSync hook, deleted
    before the next one is created (a finished Job's pod template cannot change)."""
    return {
        "helm.sh/hook": "pre-install,pre-upgrade",
        "helm.sh/hook-weight": str(weight),
        "helm.sh/hook-delete-policy": "before-hook-creation",
        "argocd.argoproj.io/hook": "PreSync",
        "argocd.argoproj.io/hook-delete-policy": "BeforeHookCreation",
        "argocd.argoproj.io/sync-wave": str(weight),
    }


_JOBS = _Part("jobs", ("jobs",))


def _job(name: Any, component: str, containers: list[Any], weight: int, key: str
         ) -> dict[str, Any]:
    # jobs.<key>.hook false: a plain Job, for tools that apply a chart's objects without
    # running hooks (Flux's and Terraform's helm releases can; a GitOps render cannot).
    hook = _JOBS(key, "hook")
    annotations = {k: When(hook, v) for k, v in _hooks(weight).items()}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _meta(name, component, _JOBS, annotations=annotations),
        "spec": {
            "backoffLimit": _JOBS("backoffLimit"),
            # Kept a day for its logs; the next release's hook deletes it first anyway.
            "ttlSecondsAfterFinished": _JOBS("ttlSecondsAfterFinished"),
            "template": {
                "metadata": {"labels": {**_labels(component), Spread(_JOBS("podLabels")): None},
                             "annotations": _when_set(_JOBS("podAnnotations"), block=True)},
                # No ServiceAccount of the release: a hook runs before it exists.
                "spec": _pod(_JOBS, containers, grace=30, restart="OnFailure",
                             service_account=_JOBS("serviceAccountName"),
                             component=component)},
        },
    }


def _jobs() -> list[Doc]:
    pool = Key("pool")
    migrate = _container("migrate", ["migrate"], _Part("migrate", ("jobs",)),
                         inline_config=True)
    topics = Each(_root("workers", "pools"), "pool", _container(
        Printf("topics-%s", Dashed(pool)), ["topics", "create", "--pool", pool],
        _Part("kafka-setup", ("jobs",)), inline_config=True), defaults=_POOL_DEFAULTS)
    schemas = _container("schemas", ["schemas", "register"], _Part("kafka-setup", ("jobs",)),
                         inline_config=True)
    return [
        Doc(lambda _c: "jobs/20-migrate-job.yaml", "job-migrate.yaml",
            _job(_named("migrate"), "migrate", [migrate], -10, "migrate")),
        # Topics of every pool and the schemas, before any producer or consumer starts.
        # Each is idempotent, so the Job runs again with every release.
        Doc(lambda _c: "jobs/21-kafka-setup-job.yaml", "job-kafka-setup.yaml",
            _job(_named("kafka-setup"), "kafka-setup", [topics, schemas], -5, "kafkaSetup")),
    ]


_API = _Part("api", ("api",))


def _api() -> list[Doc]:
    api = _API
    console_port = api("console", "port")
    container = _container(
        "api", ["api"], api,
        env=[{"name": "CALMQ_API_HOST", "value": "0.0.0.0"},
             {"name": "CALMQ_API_PORT", "value": Text(api("port"))},
             {"name": "CALMQ_API_METRICS_PORT", "value": Text(api("metricsPort"))},
             {"name": "CALMQ_API_CONSOLE", "value": Text(api("console", "enabled"))},
             When(console_port, {"name": "CALMQ_API_CONSOLE_PORT", "value": Text(console_port)})],
        ports=[{"name": "http", "containerPort": api("port")},
               {"name": "metrics", "containerPort": api("metricsPort")},
               When(console_port, {"name": "console", "containerPort": console_port})],
        probes=("http", "/healthz", "/readyz"),
        # Endpoints are removed from the Service while the pod still serves: a pause before
        # SIGTERM lets every proxy stop sending to it, so a rollout drops no request.
        lifecycle={"preStop": {"sleep": {"seconds": api("preStopSeconds")}}})
    pod = _pod(api, [container], grace=api("terminationGracePeriodSeconds"))
    deployment = _deployment(_named("api"), "api", api, pod, replicas=api("replicas"))
    deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = When(
        _root("scrapeAnnotations"), Text(api("metricsPort")))
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {**_meta(_named("api"), "api"),
                     "annotations": _when_set(api("service", "annotations"), block=True)},
        "spec": {"type": api("service", "type"), "selector": _selector("api"),
                 "ports": [{"name": "http", "port": api("service", "port"),
                            "targetPort": "http"},
                           When(console_port, {"name": "console", "port": console_port,
                                               "targetPort": "console"})]},
    }
    pdb = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(_named("api"), "api"),
        "spec": {"minAvailable": api("pdb", "minAvailable"),
                 "selector": {"matchLabels": _selector("api")}},
    }
    return [
        Doc(lambda _c: "30-api-deployment.yaml", "api.yaml", deployment),
        Doc(lambda _c: "30-api-service.yaml", "api.yaml", service),
        Doc(lambda _c: "30-api-pdb.yaml", "api.yaml", pdb,
            when=And((api("pdb", "enabled"), Above(api("replicas"), 1)))),
        *_routes(),
    ]


_GATEWAY_API = "gateway.networking.k8s.io/v1"


def _routes() -> list[Doc]:
    """The API from outside: an Ingress or a Gateway API HTTPRoute. Each carries what the
    API's requests need of a proxy: an upload's body size (ingress-nginx's annotation; a
    Gateway's own policy), and SSE streams and Prefer: wait held open for their time."""
    ingress, route = ("api", "ingress"), ("api", "httpRoute")
    seconds = Text(Val((*ingress, "timeoutSeconds")))
    nginx = Val((*ingress, "nginx"))
    annotations = {
        "nginx.ingress.kubernetes.io/proxy-body-size": When(nginx, Val((*ingress, "bodySize"))),
        "nginx.ingress.kubernetes.io/proxy-read-timeout": When(nginx, seconds),
        "nginx.ingress.kubernetes.io/proxy-send-timeout": When(nginx, seconds),
        # SSE: each event reaches the client when it is written, not when a buffer fills.
        "nginx.ingress.kubernetes.io/proxy-buffering": When(nginx, "off"),
        Spread(Val((*ingress, "annotations"))): None,
    }
    backend = {"service": {"name": _named("api"),
                           "port": {"number": _API("service", "port")}}}
    host = Val((*ingress, "host"))
    ing = {
        "apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
        "metadata": {**_meta(_named("api"), "api"), "annotations": annotations},
        "spec": {
            "ingressClassName": _when_set(Val((*ingress, "className"))),
            "tls": _when_set(Val((*ingress, "tls")), block=True),
            "rules": [{"host": When(host, host), "http": {"paths": [{
                "path": Val((*ingress, "path")), "pathType": "Prefix",
                "backend": backend}]}}],
        },
    }
    timeout = Printf("%ss", Text(Val((*route, "timeoutSeconds"))))
    http_route = {
        Check(Fail(Not(Served(_GATEWAY_API)),
                   f"api.httpRoute.enabled: this cluster serves no {_GATEWAY_API} (the "
                   "Gateway API's CRDs): install them, or use api.ingress")): None,
        "apiVersion": _GATEWAY_API, "kind": "HTTPRoute",
        "metadata": {**_meta(_named("api"), "api"),
                     "annotations": _when_set(Val((*route, "annotations")), block=True)},
        "spec": {
            "parentRefs": Val((*route, "parentRefs"), block=True),
            "hostnames": _when_set(Val((*route, "hostnames")), block=True),
            "rules": [{"backendRefs": [{"name": _named("api"),
                                        "port": _API("service", "port")}],
                       "timeouts": {"request": timeout, "backendRequest": timeout}}],
        },
    }
    return [Doc(lambda _c: "31-api-ingress.yaml", "ingress.yaml", ing,
                when=Val((*ingress, "enabled"))),
            Doc(lambda _c: "31-api-httproute.yaml", "ingress.yaml", http_route,
                when=Val((*route, "enabled")))]


def _singletons() -> list[Doc]:
    relay, forwarder, reaper = (_Part(n, (n,)) for n in ("relay", "forwarder", "reaper"))
    return [
        # One relay: it owns the replication slot. Recreate stops the old pod before the new
        # one starts, so a rollout never has two relays waiting on the slot.
        Doc(lambda _c: "40-relay-deployment.yaml", "relay.yaml", _deployment(
            _named("relay"), "relay", relay,
            _pod(relay, [_metrics_part("relay", relay, ["relay"])],
                 grace=relay("terminationGracePeriodSeconds")),
            replicas=1, strategy="Recreate")),
        Doc(lambda _c: "50-forwarder-deployment.yaml", "forwarder.yaml", _deployment(
            _named("forwarder"), "forwarder", forwarder,
            _pod(forwarder, [_metrics_part("forwarder", forwarder, ["forwarder"])],
                 grace=forwarder("terminationGracePeriodSeconds")),
            replicas=forwarder("replicas"))),
        Doc(lambda _c: "50-reaper-deployment.yaml", "reaper.yaml", _deployment(
            _named("reaper"), "reaper", reaper,
            _pod(reaper, [_metrics_part("reaper", reaper, ["reaper"])],
                 grace=reaper("terminationGracePeriodSeconds")),
            replicas=reaper("replicas"))),
    ]


_POOL_DEFAULTS = ("workers", "poolDefaults")


def _pool_each(where: Any = None) -> Each:
    return Each(_root("workers", "pools"), "pool", None, where=where, defaults=_POOL_DEFAULTS)


def _workers() -> list[Doc]:
    """Per pool: the workers (their grace period covers the pool's longest step, so a
    scale-down lets every model call finish instead of cutting it and redoing the job
    elsewhere), their ScaledObject, and the batch lane's batcher."""
    pool = Key("pool")
    worker = _Part("worker", (), "pool")
    batcher = _Part("batcher", ("batcher",), "pool")
    keda_on = Val(("keda", "enabled"), "pool")
    container = _metrics_part("worker", worker, ["worker"], pool=pool, env=[
        {"name": "CALMQ_POOL", "value": pool},
        {"name": "CALMQ_PRIORITIES", "value": Text(worker("priorities"))},
        {"name": "CALMQ_CONCURRENCY", "value": Text(worker("concurrency"))},
        {"name": "CALMQ_GRACE_SECONDS", "value": Text(worker("graceSeconds"))}])
    deployment = _deployment(
        _named("worker-%s", Dashed(pool)), "worker", worker,
        _pod(worker, [container], grace=worker("terminationGracePeriodSeconds")),
        # With KEDA, no replicas: a sync would reset a busy pool to this count.
        replicas=When(Not(keda_on), worker("replicas")), pool=pool)
    scaled: dict[Any, Any] = {
        # Asked for and not served: say so, instead of an apply that fails on a kind the
        # cluster does not know (or, worse, a pool no one scales).
        Check(Fail(Not(Served(keda.API_VERSION)),
                   f"workers: KEDA is enabled but this cluster serves no {keda.API_VERSION}:"
                   " install KEDA, or set workers.poolDefaults.keda.enabled=false (each pool"
                   " then runs its replicas)")): None,
        **keda.scaled_object(_meta(_named("worker-%s", Dashed(pool)), "worker", pool=pool))}
    auth = keda.trigger_authentication(_meta(_named("worker-%s", Dashed(pool)),
                                             "worker", pool=pool))
    batch = _container("batcher", ["batcher", "--metrics-port", str(METRICS_PORT)], batcher,
                       env=[{"name": "CALMQ_POOL", "value": pool}],
                       ports=[{"name": "metrics", "containerPort": METRICS_PORT}],
                       probes=("metrics", "/livez", "/metrics"))
    # A pool's batch lane (`calmq batcher`): one replica packs and polls; pollers share
    # batches by lease and packers claim jobs like workers, so more replicas are safe.
    batcher_deployment = _deployment(
        _named("batcher-%s", Dashed(pool)), "batcher", batcher,
        _pod(batcher, [batch], grace=batcher("terminationGracePeriodSeconds")),
        replicas=batcher("replicas"), pool=pool)

    def named(fmt: str) -> Any:
        return lambda c: fmt % c.scopes["pool"].key

    return [
        Doc(named("60-worker-%s-deployment.yaml"), "workers.yaml", deployment,
            each=_pool_each()),
        Doc(named("60-worker-%s-scaledobject.yaml"), "workers.yaml", scaled,
            each=_pool_each(keda_on)),
        Doc(named("60-worker-%s-triggerauthentication.yaml"), "workers.yaml", auth,
            each=_pool_each(And((keda_on, keda.needs_trigger_authentication())))),
        Doc(named("61-batcher-%s-deployment.yaml"), "workers.yaml", batcher_deployment,
            each=_pool_each(Val(("batcher", "enabled"), "pool"))),
        # Opt-in: a pool that scales to zero, or runs one replica, must not block drains.
        Doc(named("62-worker-%s-pdb.yaml"), "workers.yaml", {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(_named("worker-%s", Dashed(pool)), "worker", pool=pool),
            "spec": {"maxUnavailable": worker("pdb", "maxUnavailable"),
                     "selector": {"matchLabels": _selector("worker", pool)}}},
            each=_pool_each(Val(("pdb", "enabled"), "pool"))),
    ]


def _podmonitor(component: str) -> dict[Any, Any]:
    endpoint: dict[str, Any] = {"port": "metrics", "path": "/metrics",
                                "interval": _root("monitoring", "podMonitor", "interval")}
    if component in ("worker", "batcher"):
        # The pool as a target label, as the pod-annotation scrape config sets it.
        endpoint["relabelings"] = [{"sourceLabels": ["__meta_kubernetes_pod_label_calmq_dev_pool"],
                                    "targetLabel": "pool"}]
    meta = _meta(_named(component), component)
    meta["labels"][Spread(_root("monitoring", "podMonitor", "labels"))] = None
    return {
        Check(_operator_check("monitoring.podMonitor.enabled")): None,
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            # job="calmq-<part>", the same name the pod-annotation scrape config gives, so
            # the alert rules hold for either.
            "jobLabel": "calmq.dev/job",
            "selector": {"matchLabels": _selector(component)},
            "podMetricsEndpoints": [endpoint],
        },
    }


def _runbook(rule: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(rule)
    notes = out.get("annotations", {})
    if "runbook_url" in notes:
        notes["runbook_url"] = Printf(
            "%s%s", _root("monitoring", "prometheusRule", "runbookBaseUrl"),
            notes["runbook_url"])
    return out


_MONITORING_API = "monitoring.coreos.com/v1"


def _operator_check(value: str) -> Fail:
    return Fail(Not(Served(_MONITORING_API)),
                f"{value}: this cluster serves no {_MONITORING_API} (the Prometheus "
                "Operator's CRDs): install the operator, or set it false and scrape the "
                "pods' prometheus.io annotations (scrapeAnnotations)")


def _fixed(name: str) -> Callable[[Context], str]:
    return lambda _c: name


def _monitoring() -> list[Doc]:
    import yaml

    on = _root("monitoring", "podMonitor", "enabled")
    docs = [Doc(_fixed(f"70-podmonitor-{name}.yaml"), "podmonitors.yaml", _podmonitor(name),
                when=on)
            for name in ("api", "relay", "forwarder", "reaper", "worker", "batcher")]
    alerts = yaml.safe_load(monitoring_file("alerts.yml"))
    rule_meta = _meta(FullName(), "monitoring")
    rule_meta["labels"][Spread(_root("monitoring", "prometheusRule", "labels"))] = None
    docs.append(Doc(lambda _c: "71-prometheusrule.yaml", "prometheusrule.yaml", {
        Check(_operator_check("monitoring.prometheusRule.enabled")): None,
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
        "metadata": rule_meta,
        "spec": {"groups": [{**group, "rules": [_runbook(r) for r in group["rules"]]}
                            for group in alerts["groups"]]},
    }, when=_root("monitoring", "prometheusRule", "enabled")))
    dash = _root("monitoring", "dashboard")
    dash_meta = _meta(_named("dashboard"), "monitoring")
    dash_meta["labels"][Spread(Val((*dash.path, "labels")))] = None
    dash_meta["annotations"] = _when_set(Val((*dash.path, "annotations")), block=True)
    docs.append(Doc(lambda _c: "72-dashboard-configmap.yaml", "dashboard.yaml", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": dash_meta,
        "data": {"calmq.json": FileText("calmq-dashboard.json")},
    }, when=Val((*dash.path, "enabled"))))
    return docs


def _network_policies() -> list[Doc]:
    """Who may reach the pods: the API port from ``apiFrom`` (anyone when empty), the
    metrics port from ``metricsFrom`` (the monitoring namespace, say) and the console's own
    port from ``consoleFrom``; the other parts take no traffic but scrapes."""
    net = ("networkPolicy",)

    def rule(port: str, peers: str) -> dict[str, Any]:
        return {"ports": [{"port": port, "protocol": "TCP"}],
                "from": _when_set(Val((*net, peers)), block=True)}

    def policy(name: Any, selector: dict[str, Any], rules: list[Any]) -> dict[str, Any]:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": _meta(name, "network-policy"),
                "spec": {"podSelector": selector, "policyTypes": ["Ingress"],
                         "ingress": rules}}

    api = policy(_named("api"), {"matchLabels": _selector("api")}, [
        rule("http", "apiFrom"), rule("metrics", "metricsFrom"),
        When(_API("console", "port"), rule("console", "consoleFrom"))])
    parts = policy(_named("parts"), {
        "matchLabels": {"app.kubernetes.io/name": _NAME, "app.kubernetes.io/instance": Release()},
        "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                              "values": ["relay", "forwarder", "reaper", "worker",
                                         "batcher"]}]}, [rule("metrics", "metricsFrom")])
    on = Val((*net, "enabled"))
    return [Doc(lambda _c: "80-networkpolicy-api.yaml", "networkpolicy.yaml", api, when=on),
            Doc(lambda _c: "80-networkpolicy-parts.yaml", "networkpolicy.yaml", parts,
                when=on)]


def _base() -> list[Doc]:
    ns_labels = {"app.kubernetes.io/name": "calmq", "app.kubernetes.io/component": "namespace",
                 # PodSecurity admission: every calmq pod meets the restricted profile.
                 "pod-security.kubernetes.io/enforce": _root("namespace", "podSecurity"),
                 "pod-security.kubernetes.io/audit": _root("namespace", "podSecurity"),
                 "pod-security.kubernetes.io/warn": _root("namespace", "podSecurity"),
                 Spread(_root("namespace", "labels")): None}
    account = _meta(Default(_root("serviceAccount", "name"), FullName()), "service-account")
    # For IRSA / Workload Identity: the cloud role that may read and write the bucket.
    account["annotations"] = _when_set(_root("serviceAccount", "annotations"), block=True)
    config_meta = _meta(FullName(), "config")
    # A ConfigMap without a provider is never rendered: every model call would fail.
    provider = Required(_root("config", "provider_url"),
                        "config.provider_url is required: the model provider's URL "
                        "(https://api.openai.com, https://api.anthropic.com, a vLLM or "
                        "LiteLLM address)")
    return [
        Doc(lambda _c: "00-namespace.yaml", "namespace.yaml",
            {"apiVersion": "v1", "kind": "Namespace",
             "metadata": {"name": Namespace(), "labels": ns_labels}},
            when=_root("namespace", "create")),
        Doc(lambda _c: "05-serviceaccount.yaml", "serviceaccount.yaml",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": account,
             "automountServiceAccountToken": False},
            when=_root("serviceAccount", "create")),
        Doc(lambda _c: "10-configmap.yaml", "configmap.yaml",
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": config_meta,
             "data": {Check(provider): None, Check(NoSecrets()): None,
                      Entries(_root("config"), "cfg", Printf("CALMQ_%s", Upper(Key("cfg"))),
                              Text(Val((), "cfg"))): None}}),
    ]


def _tests() -> list[Doc]:
    """`helm test`: a pod that runs `calmq health` against the release's own parts, with
    the settings and Secrets a worker has. The chart's alone: a Kustomize base would run
    it as a plain pod on every apply."""
    part = _Part("worker", ("jobs",))
    container = _container("health", ["health"], part, env=[
        {"name": "CALMQ_API_URL",
         "value": Printf("http://%s:%s", _named("api"), Text(_API("service", "port")))}])
    meta = _meta(_named("test"), "test")
    meta["annotations"] = {"helm.sh/hook": "test",
                           "helm.sh/hook-delete-policy": "before-hook-creation"}
    pod = _pod(part, [container], grace=5, restart="Never", component="worker")
    return [Doc(lambda _c: "90-test-pod.yaml", "tests/test-health.yaml",
                {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod},
                when=_root("tests", "enabled"), chart_only=True)]


def _extra_objects() -> list[Doc]:
    """``extraObjects``: any object of your own, each a document of the release."""
    return [Doc(lambda c: f"95-extra-{c.scopes['extra'].key}.yaml", "extra-objects.yaml",
                None, items=_root("extraObjects"))]


def _docs() -> list[Doc]:
    return [*_base(), *_jobs(), *_api(), *_singletons(), *_workers(), *_monitoring(),
            *_network_policies(), *_tests(), *_extra_objects()]


def monitoring_file(name: str) -> str:
    """The alert rules or the dashboard, as the package ships them (copies of
    deploy/prometheus/alerts.yml and deploy/grafana/calmq-dashboard.json)."""
    return resources.files("calmq.tooling").joinpath("monitoring", name).read_text("utf-8")


def chart_files() -> dict[str, str]:
    """The chart's ``files/``: what the templates read with ``.Files.Get``."""
    return {"calmq-dashboard.json": monitoring_file("calmq-dashboard.json")}


class _LazyDocs(Sequence[Doc]):
    """The documents, built on first use (reading the alert rules is file work)."""

    _docs: list[Doc] | None = None

    def _all(self) -> list[Doc]:
        if self._docs is None:
            self._docs = _docs()
        return self._docs

    def __getitem__(self, index: Any) -> Any:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())


DOCS: Sequence[Doc] = _LazyDocs()
_WORKER_FILES = ("60-worker-",)


def render(values: Mapping[str, Any], namespace: str = "calmq", *, only: str | None = None
           ) -> dict[str, dict[str, Any]]:
    """``{file name: manifest}`` of the values; the numbers in the names are the order to
    apply them in (``jobs/`` first: they are hooks). ``only="workers"``: the worker
    Deployments and their ScaledObjects alone."""
    from calmq.tooling.values_schema import check_values

    ctx = Context(values, namespace, chart_files())
    # Before any document: the hook Jobs carry the config inline, and --only workers
    # renders no ConfigMap, so its check alone would not see every path.
    NoSecrets().evaluate(ctx)
    # As helm checks values.schema.json: a misspelt value fails, naming its path.
    check_values(values)
    if only is None:
        return dict(documents(DOCS, ctx))
    if only != "workers":
        raise ConfigError(f"--only {only}: the one subset is workers", code="invalid_values")
    docs = [d for d in DOCS if d.template == "workers.yaml"]
    return {k: v for k, v in documents(docs, ctx) if k.startswith(_WORKER_FILES)}


def values_for(settings: Settings, *files: Path) -> dict[str, Any]:
    """The settings' default values, with each values file merged over them in order."""
    return merge_values(default_values(settings), *(load_values(f) for f in files))


def secret_template(values: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    """The Secret ``calmq``'s shape with placeholders: the keys the ``secretSettings`` read
    from it and the files the ``secretFiles`` mount from it. Create the real one with
    kubectl, or your secret manager (docs)."""
    def keys(group: str) -> set[str]:
        return {str(ref["key"]) for ref in (values.get(group) or {}).values()
                if ref and ref.get("secretName") == CONFIG_NAME and ref.get("key")}

    data = {k: SECRET_PLACEHOLDERS.get(k, "CHANGE-ME") for k in keys("secretSettings")}
    for name, ref in (values.get("secretFiles") or {}).items():
        if ref and ref.get("secretName") == CONFIG_NAME and ref.get("key"):
            data[str(ref["key"])] = ("CHANGE-ME (PEM)" if name.endswith(_FILE_SETTING)
                                     else "CHANGE-ME")
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": CONFIG_NAME, "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": "calmq",
                                    "app.kubernetes.io/component": "config"}},
            "stringData": dict(sorted(data.items()))}


def kustomization(manifests: Mapping[str, dict[str, Any]], values: Mapping[str, Any],
                  namespace: str) -> dict[str, dict[str, Any]]:
    """The Kustomize base: ``kustomization.yaml`` for the folder (the ConfigMap generated,
    so its name carries a hash of its data and a change rolls the pods; the image under
    ``images:``; the namespace) and ``jobs/kustomization.yaml`` for the hook Jobs."""
    config = manifests["10-configmap.yaml"]
    image = values["image"]
    entry: dict[str, Any] = {"name": str(image["repository"]),
                             "newName": str(image["repository"])}
    if image.get("digest"):
        entry["digest"] = str(image["digest"])
    else:
        entry["newTag"] = str(image["tag"])
    top = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": namespace,
        "resources": [f for f in manifests if "/" not in f and f != "10-configmap.yaml"]
        + ["jobs"],
        "configMapGenerator": [{
            "name": CONFIG_NAME,
            "options": {"labels": dict(config["metadata"]["labels"])},
            "literals": [f"{k}={v}" for k, v in config["data"].items()],
        }],
        "images": [entry],
    }
    jobs = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": sorted(f.removeprefix("jobs/") for f in manifests
                                if f.startswith("jobs/"))}
    return {"kustomization.yaml": top, "jobs/kustomization.yaml": jobs}


def dump(manifest: Any, command: str) -> str:
    """YAML with the header naming the command, and no anchors: the labels a Deployment
    repeats in its selector and template are written out, as a reader expects them."""
    import yaml

    class _Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    header = f"# Rendered by `{command}`; edit the values, not this file.\n"
    return header + yaml.dump(manifest, Dumper=_Plain, sort_keys=False, width=100)


def dump_all(manifests: Mapping[str, dict[str, Any]], command: str) -> str:
    """Every manifest as one multi-document YAML stream (what `-o -` prints)."""
    return "".join(("---\n" if i else "") + dump(m, command)
                   for i, m in enumerate(manifests.values()))


def _prune(folder: Path, keep: set[str], command: str) -> None:
    """Remove files an earlier render of the same command wrote that this one does not (a
    pool that is gone, a file that moved), never a file of anyone else."""
    if not folder.is_dir():
        return
    mark = f"# Rendered by `{command}`"
    for path in sorted(folder.rglob("*.yaml")):
        name = str(path.relative_to(folder))
        if name not in keep and path.read_text(encoding="utf-8").startswith(mark):
            path.unlink()


def write(values: Mapping[str, Any], folder: Path, namespace: str = "calmq", *,
          only: str | None = None, command: str = "calmq k8s render") -> list[Path]:
    """Render into ``folder``: the manifests, the hook Jobs in ``jobs/`` (where `kubectl
    apply -f folder` does not re-apply them), the Kustomize base, and the Secret's template
    in ``secret-template/`` (never applied with the folder)."""
    manifests = render(values, namespace, only=only)
    files: dict[str, Any] = dict(manifests)
    if only is None:
        files.update(kustomization(manifests, values, namespace))
        files["secret-template/calmq-secret.yaml"] = secret_template(values, namespace)
    _prune(folder, set(files), command)
    written = []
    for name, manifest in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump(manifest, command), encoding="utf-8")
        written.append(path)
    return written
