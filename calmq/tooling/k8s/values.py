"""The chart's values, computed from the settings and the registered workflows
(calmq/tooling/kubernetes.py's step 1): the settings a render starts from, the ``config``
the ConfigMap holds, each part's resources and scheduling, and each pool's own values."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from calmq.errors import ConfigError
from calmq.settings import Settings
from calmq.tooling import keda
from calmq.tooling.k8s.secrets import SECRET_FILES, SECRET_SETTINGS, secret_values
from calmq.workflows import Workflow, load_workflows

API_PORT = 8080
METRICS_PORT = 9100
# After the grace period a worker still commits its offsets, leaves the group and closes
# its pools; measured well under 5 s, so 15 s is ample before the kubelet's SIGKILL.
DRAIN_SECONDS = 15

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
        **_release_values(settings),
        "config": config_values(settings),
        "secretsVersion": "",
        "secretSettings": secrets,
        "secretFiles": files,
        "extraEnv": [],
        "serviceAccount": {"create": True, "name": "", "annotations": {}},
        "scrapeAnnotations": True,
        "api": _api_values(settings),
        **_part_values(),
        "workers": {"poolDefaults": defaults, "pools": pools},
        **_optional_values(),
    }


def _release_values(settings: Settings) -> dict[str, Any]:
    """The image, the names and what every pod of the release shares."""
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
    }


def _api_values(settings: Settings) -> dict[str, Any]:
    return {
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
    }


def _part_values() -> dict[str, Any]:
    """The relay, the forwarder, the reaper, the hook Jobs and `helm test`."""
    return {
        "relay": {"terminationGracePeriodSeconds": 30, **_part(RESOURCES["relay"])},
        "forwarder": {"replicas": 1, "terminationGracePeriodSeconds": 30,
                      **_part(RESOURCES["forwarder"])},
        "reaper": {"replicas": 1, "terminationGracePeriodSeconds": 15,
                   **_part(RESOURCES["reaper"])},
        "jobs": {"backoffLimit": 4, "ttlSecondsAfterFinished": 86400,
                 "migrate": {"hook": True}, "kafkaSetup": {"hook": True},
                 **_part(RESOURCES["jobs"])},
        "tests": {"enabled": True},
    }


def _optional_values() -> dict[str, Any]:
    """What is off unless asked for: monitoring objects, NetworkPolicies, extra objects."""
    return {
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


