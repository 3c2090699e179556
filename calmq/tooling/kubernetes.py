"""Kubernetes manifests for every part of calmq, from one settings source (`calmq k8s render`).

What is rendered (docs/how-to/deploy-kubernetes.md says how to apply it):

- one ConfigMap holding every setting the parts read, and one Secret (a template, kept out
  of the applied folder) for the database URL and the provider key; every container takes
  both with ``envFrom``, so no part can miss a setting the others have (the token budget,
  the workflow modules, the retry tiers and the price table reach every worker);
- the migration Job (``calmq migrate``) and the Kafka setup Job (topics, schemas);
- the API (Deployment + Service + PodDisruptionBudget), the relay (one replica,
  ``Recreate``), the retry forwarder, the reaper, and per worker pool a Deployment with
  its KEDA ScaledObject (calmq/tooling/keda.py; `calmq keda render` writes that subset).

Every pod sets ``enableServiceLinks: false``: a Service named ``calmq-*`` would otherwise
inject ``CALMQ_*_PORT=tcp://...`` variables that look like settings.
"""

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
from calmq.workflows import Workflow, load_workflows

__all__ = [
    "CONFIG_NAME",
    "SECRET_KEYS",
    "Resources",
    "config_values",
    "dump",
    "load_values",
    "render",
    "secret_template",
    "write",
]

CONFIG_NAME = "calmq"  # the ConfigMap and the Secret
# The Secret's keys are the settings' own variable names, so envFrom needs no mapping.
SECRET_KEYS = ("CALMQ_DATABASE_URL", "CALMQ_PROVIDER_API_KEY")
SECRET_PLACEHOLDERS = {
    "CALMQ_DATABASE_URL": "postgresql://calmq:CHANGE-ME@postgres:5432/calmq",
    "CALMQ_PROVIDER_API_KEY": "CHANGE-ME",
}
API_PORT = 8080
METRICS_PORT = 9100
# After the grace period a worker still commits its offsets, leaves the group and closes
# its pools; measured well under 5 s, so 15 s is ample before the kubelet's SIGKILL.
DRAIN_SECONDS = 15

# Settings that are not the ConfigMap's: secrets, each Deployment's own, the local stack's,
# and the renderer's inputs.
_PER_PART = frozenset({"pool", "priorities", "concurrency", "worker_id", "api_host",
                       "api_port"})
_NOT_IN_CLUSTER = frozenset({"api_url", "fake_provider_url", "database_url",
                             "provider_api_key"})
_RENDER_ONLY_PREFIX = "keda_"


@dataclass(frozen=True)
class Resources:
    """Requests and limits of one container, from the figures measured in
    docs/how-to/deploy-kubernetes.md (peak RSS and CPU of each part under load)."""

    cpu_request: str
    memory_request: str
    cpu_limit: str
    memory_limit: str

    def manifest(self) -> dict[str, dict[str, str]]:
        return {"requests": {"cpu": self.cpu_request, "memory": self.memory_request},
                "limits": {"cpu": self.cpu_limit, "memory": self.memory_limit}}


# Measured (docs/how-to/deploy-kubernetes.md): peak RSS api 68 MiB, relay 82-89, worker
# 99-122 (concurrency 256, 1,170 jobs/s), forwarder 71, reaper 61; CPU at 1,170 jobs/s api
# 0.23 core, relay 0.14, worker 0.5. Memory requests sit above the measured peak, limits at
# about twice it (larger payloads, a busier heap); CPU requests near the steady state at
# moderate load, limits at one core or less.
RESOURCES: dict[str, Resources] = {
    "api": Resources("100m", "96Mi", "1", "256Mi"),
    "relay": Resources("50m", "128Mi", "1", "256Mi"),
    "worker": Resources("200m", "160Mi", "1", "384Mi"),
    "forwarder": Resources("20m", "96Mi", "500m", "192Mi"),
    "reaper": Resources("10m", "80Mi", "250m", "160Mi"),
    # Not measured yet: a pack holds its requests' bytes (up to CALMQ_BATCH_MAX_BYTES) and
    # one waiting attempt per job; collecting streams results in 64 KiB reads.
    "batcher": Resources("50m", "256Mi", "1", "768Mi"),
    "job": Resources("50m", "96Mi", "500m", "256Mi"),
}


def load_values(path: Path | None, environ: Mapping[str, str],
                flags: Mapping[str, Any] | None = None) -> Settings:
    """Settings from a values file (YAML ``setting: value``), then ``CALMQ_*`` variables,
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


def _text(value: Any) -> str | None:
    """A setting's value as its CALMQ_ variable would spell it; None: leave it unset."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, dict):
        return json.dumps({k: v.model_dump() if hasattr(v, "model_dump") else v
                           for k, v in sorted(value.items())}, separators=(",", ":"))
    if isinstance(value, SecretStr):
        return None
    return str(value)


def config_values(settings: Settings) -> dict[str, str]:
    """The ConfigMap: every setting a part reads, with in-cluster names for empty locations.

    All of them, not only those that differ from the defaults, so that a reader of the
    ConfigMap sees what every pod runs with and a changed default cannot split the fleet.
    """
    out: dict[str, str] = {}
    for name in Settings.model_fields:
        if name in _PER_PART or name in _NOT_IN_CLUSTER or name.startswith(_RENDER_ONLY_PREFIX):
            continue
        value = getattr(settings, name)
        if name in keda.PLACEHOLDERS and not value:
            value = keda.PLACEHOLDERS[name]
        text = _text(value)
        if text is not None:
            out["CALMQ_" + name.upper()] = text
    return dict(sorted(out.items()))


def _labels(component: str, **extra: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "calmq", "app.kubernetes.io/component": component,
            **extra}


def _meta(settings: Settings, name: str, labels: dict[str, str],
          annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": settings.keda_namespace,
                            "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return meta


def _probe(path: str, port: str, *, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": 2, "failureThreshold": failures}


def _container(settings: Settings, name: str, args: list[str], *, resources: Resources,
               env: Mapping[str, str] | None = None, port: tuple[str, int] | None = None,
               probes: tuple[str, str] | None = None) -> dict[str, Any]:
    """One calmq container: ``calmq <args>``, every setting from the ConfigMap and Secret.

    ``probes`` is (liveness path, readiness path) on ``port``; the parts without an HTTP
    API are probed on their metrics port, which answers while the process runs.
    """
    container: dict[str, Any] = {
        "name": name,
        "image": settings.keda_image,
        "command": ["calmq"],
        "args": args,
        "envFrom": [{"configMapRef": {"name": CONFIG_NAME}},
                    {"secretRef": {"name": CONFIG_NAME}}],
    }
    if env:
        # env wins over envFrom: a Deployment's own settings (its pool) over the shared ones.
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if port is not None:
        container["ports"] = [{"name": port[0], "containerPort": port[1]}]
    if probes is not None and port is not None:
        live, ready = probes
        container["startupProbe"] = _probe(ready, port[0], period=2, failures=30)
        container["livenessProbe"] = _probe(live, port[0], period=10, failures=3)
        container["readinessProbe"] = _probe(ready, port[0], period=5, failures=2)
    container["resources"] = resources.manifest()
    container["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    container["volumeMounts"] = [{"name": "tmp", "mountPath": "/tmp"}]  # noqa: S108
    return container


def _pod(containers: list[dict[str, Any]], *, grace: int, restart: str = "Always"
         ) -> dict[str, Any]:
    spec: dict[str, Any] = {
        # Service links would inject CALMQ_<SERVICE>_PORT=tcp://... for a Service named
        # calmq-*; calmq tolerates them, but they are noise and shadow real settings.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # calmq never calls the Kubernetes API
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": grace,
        # The image's user (Dockerfile: uid 10001); the root filesystem is read-only and
        # the only writable place is /tmp (uploads spool there before the object store).
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": containers,
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
    }
    return spec


def _scrape(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}


def _deployment(settings: Settings, name: str, labels: dict[str, str], pod: dict[str, Any],
                *, replicas: int, port: int, strategy: str = "RollingUpdate") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": labels},
        "strategy": {"type": strategy},
        "template": {"metadata": {"labels": labels, "annotations": _scrape(port)},
                     "spec": pod},
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(settings, name, labels), "spec": spec}


def _job(settings: Settings, name: str, containers: list[dict[str, Any]]) -> dict[str, Any]:
    labels = _labels(name.removeprefix("calmq-"))
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _meta(settings, name, labels),
        "spec": {
            "backoffLimit": 4,
            # Kept a day for its logs; delete it before the next release applies it again
            # (a Job's pod template cannot change in place).
            "ttlSecondsAfterFinished": 86400,
            "template": {"metadata": {"labels": labels},
                         "spec": _pod(containers, grace=30, restart="OnFailure")},
        },
    }


def _metrics_part(settings: Settings, component: str, args: list[str]) -> dict[str, Any]:
    return _container(settings, component, [*args, "--metrics-port", str(METRICS_PORT)],
                      resources=RESOURCES[component], port=("metrics", METRICS_PORT),
                      probes=("/metrics", "/metrics"))


def longest_step(settings: Settings, workflows: Mapping[str, Workflow], pool: str) -> float:
    """The longest step timeout of the steps routed to ``pool`` (the override wins)."""
    if settings.step_timeout_seconds is not None:
        return settings.step_timeout_seconds
    timeouts = [step.timeout_seconds for wf in workflows.values() for step in wf.steps
                if (step.pool or wf.pool) == pool]
    return max(timeouts, default=60.0)  # a pool no registered workflow names: Step's default


def worker_deployment(settings: Settings, pool: str, workflows: Mapping[str, Workflow]
                      ) -> dict[str, Any]:
    """A pool's workers. Their grace period covers the pool's longest step, so a scale-down
    lets every model call finish instead of cutting it and redoing the job elsewhere."""
    grace = max(settings.grace_seconds, longest_step(settings, workflows, pool))
    env = {"CALMQ_POOL": pool, "CALMQ_PRIORITIES": settings.priorities,
           "CALMQ_CONCURRENCY": str(settings.concurrency),
           "CALMQ_GRACE_SECONDS": _text(float(grace)) or "0"}
    container = _container(settings, "worker", ["worker", "--metrics-port", str(METRICS_PORT)],
                           resources=RESOURCES["worker"], env=env,
                           port=("metrics", METRICS_PORT), probes=("/metrics", "/metrics"))
    labels = keda.labels(pool)
    return _deployment(settings, keda.worker_name(pool), labels,
                       _pod([container], grace=math.ceil(grace) + DRAIN_SECONDS),
                       # KEDA owns the count; this is only the count before KEDA first acts.
                       replicas=max(1, settings.keda_min_replicas), port=METRICS_PORT)


def configmap(settings: Settings) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(settings, CONFIG_NAME, _labels("config")),
            "data": config_values(settings)}


def secret_template(settings: Settings) -> dict[str, Any]:
    """The Secret's shape with placeholders; create the real one with kubectl (docs)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(settings, CONFIG_NAME, _labels("config")),
            "stringData": dict(SECRET_PLACEHOLDERS)}


def render(settings: Settings, workflows: dict[str, Workflow] | None = None
           ) -> dict[str, dict[str, Any]]:
    """``{file name: manifest}``; the numbers in the names are the order to apply them in."""
    registry = workflows if workflows is not None else load_workflows(settings)
    pools = keda.pools(settings, registry)
    ns = settings.keda_namespace
    out: dict[str, dict[str, Any]] = {
        "00-namespace.yaml": {"apiVersion": "v1", "kind": "Namespace",
                              "metadata": {"name": ns, "labels": _labels("namespace")}},
        "10-configmap.yaml": configmap(settings),
    }
    job_resources = RESOURCES["job"]
    out["20-migrate-job.yaml"] = _job(settings, "calmq-migrate", [
        _container(settings, "migrate", ["migrate"], resources=job_resources)])
    # Topics of every pool and the schemas, before any producer or consumer starts. Each
    # is idempotent, so the Job may run again with every release.
    out["21-kafka-setup-job.yaml"] = _job(settings, "calmq-kafka-setup", [
        *(_container(settings, f"topics-{pool}".replace("_", "-"),
                     ["topics", "create", "--pool", pool], resources=job_resources)
          for pool in pools),
        _container(settings, "schemas", ["schemas", "register"], resources=job_resources),
    ])

    api_labels = _labels("api")
    api = _container(settings, "api", ["api"], resources=RESOURCES["api"],
                     env={"CALMQ_API_HOST": "0.0.0.0", "CALMQ_API_PORT": str(API_PORT)},
                     port=("http", API_PORT), probes=("/healthz", "/readyz"))
    # The API drains open requests and SSE streams within aiohttp's shutdown timeout (60 s).
    out["30-api-deployment.yaml"] = _deployment(settings, "calmq-api", api_labels,
                                                _pod([api], grace=75), replicas=2,
                                                port=API_PORT)
    out["30-api-service.yaml"] = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(settings, "calmq-api", api_labels),
        "spec": {"selector": api_labels,
                 "ports": [{"name": "http", "port": API_PORT, "targetPort": "http"}]},
    }
    out["30-api-pdb.yaml"] = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(settings, "calmq-api", api_labels),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": api_labels}},
    }
    # One relay: it owns the replication slot. Recreate stops the old pod before the new
    # one starts, so a rollout never has two relays waiting on the slot.
    out["40-relay-deployment.yaml"] = _deployment(
        settings, "calmq-relay", _labels("relay"),
        _pod([_metrics_part(settings, "relay", ["relay"])], grace=30),
        replicas=1, port=METRICS_PORT, strategy="Recreate")
    out["50-forwarder-deployment.yaml"] = _deployment(
        settings, "calmq-forwarder", _labels("forwarder"),
        _pod([_metrics_part(settings, "forwarder", ["forwarder"])], grace=30),
        replicas=1, port=METRICS_PORT)
    out["50-reaper-deployment.yaml"] = _deployment(
        settings, "calmq-reaper", _labels("reaper"),
        _pod([_metrics_part(settings, "reaper", ["reaper"])], grace=15),
        replicas=1, port=METRICS_PORT)
    for pool in pools:
        out[f"60-worker-{pool}-deployment.yaml"] = worker_deployment(settings, pool, registry)
        out[f"60-worker-{pool}-scaledobject.yaml"] = keda.scaled_object(settings, pool)
        out[f"61-batcher-{pool}-deployment.yaml"] = batcher_deployment(settings, pool)
    return out


def batcher_deployment(settings: Settings, pool: str) -> dict[str, Any]:
    """A pool's batch lane (`calmq batcher`): one replica packs and polls; pollers share
    batches by lease and packers claim jobs like workers, so more replicas are safe."""
    container = _container(settings, "batcher",
                           ["batcher", "--metrics-port", str(METRICS_PORT)],
                           resources=RESOURCES["batcher"], env={"CALMQ_POOL": pool},
                           port=("metrics", METRICS_PORT), probes=("/metrics", "/metrics"))
    name = f"calmq-batcher-{pool}".replace("_", "-")
    return _deployment(settings, name, _labels("batcher", **{"calmq.dev/pool": pool}),
                       _pod([container], grace=max(30, math.ceil(settings.grace_seconds))),
                       replicas=1, port=METRICS_PORT)


def dump(manifest: dict[str, Any], command: str) -> str:
    """YAML with the header naming the command, and no anchors: the labels a Deployment
    repeats in its selector and template are written out, as a reader expects them."""
    import yaml

    class _Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    header = f"# Rendered by `{command}`; edit the settings, not this file.\n"
    return header + yaml.dump(manifest, Dumper=_Plain, sort_keys=False)


def write(settings: Settings, folder: Path) -> list[Path]:
    """Render into ``folder``, and the Secret's template into ``folder/secret-template``
    (a subfolder, so `kubectl apply -f folder` never applies its placeholders)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, manifest in render(settings).items():
        path = folder / file_name
        path.write_text(dump(manifest, "calmq k8s render"), encoding="utf-8")
        written.append(path)
    secret = folder / "secret-template" / "calmq-secret.yaml"
    secret.parent.mkdir(exist_ok=True)
    secret.write_text(dump(secret_template(settings), "calmq k8s render"), encoding="utf-8")
    written.append(secret)
    return written
