"""KEDA manifests: per pool, the workers' Deployment and the ScaledObject that scales it.

KEDA's Kafka scaler adds replicas while the pool's consumer group lags. Two things bound
how many replicas help (docs/how-to/autoscaling.md):

- partitions: a consumer without a partition is idle, so never more replicas than the
  partitions of the pool's topics (and ``allowIdleConsumers: false`` tells KEDA the same);
- the token budget: a replica runs ``concurrency`` model calls at once; by Little's law
  the budget keeps ``tokens_per_minute / tokens_per_job * seconds_per_call / 60`` calls in
  flight, so more replicas than that many slots only wait on 429s.

``maxReplicaCount = min(partition count, token-budget cap)``. The budget is
``budget_tokens_per_minute`` (the one the gateway enforces; 0 means none, and then the
partitions alone bound the fleet); tokens per job and seconds per call are the
``keda_*`` estimates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calmq import topics
from calmq.errors import ConfigError
from calmq.settings import Settings
from calmq.workflows import Workflow, load_workflows

__all__ = ["BudgetCap", "budget_cap", "pools", "render", "write"]

_PLACEHOLDERS = {
    # Where the in-cluster services are when the settings leave them empty (the names of
    # docker-compose.kafka.yml's services, which a cluster usually mirrors).
    "kafka_bootstrap": "kafka:9092",
    "schema_registry_url": "http://schema-registry:8080/apis/ccompat/v7",
    "object_store_url": "s3://calmq/objects",
}


@dataclass(frozen=True)
class BudgetCap:
    """The token budget's limit on replicas, with the figures it came from."""

    jobs_per_minute: float  # tokens_per_minute / tokens_per_job
    busy_slots: float  # jobs_per_minute * seconds_per_call / 60 (Little's law)
    replicas: int  # floor(busy_slots / concurrency), at least 1


def budget_cap(
    tokens_per_minute: int, tokens_per_job: int, seconds_per_call: float, concurrency: int
) -> BudgetCap:
    """How many replicas of ``concurrency`` slots the budget keeps busy (at least one)."""
    if min(tokens_per_minute, tokens_per_job, concurrency) < 1 or seconds_per_call <= 0:
        raise ConfigError("budget figures and concurrency must be positive")
    jobs_per_minute = tokens_per_minute / tokens_per_job
    busy_slots = jobs_per_minute * seconds_per_call / 60
    # Floor: a replica the budget cannot keep busy only adds 429s. One replica at least, so
    # that a small budget still drains its queue (more slowly).
    return BudgetCap(jobs_per_minute, busy_slots, max(1, math.floor(busy_slots / concurrency)))


def pools(settings: Settings, workflows: dict[str, Workflow] | None = None) -> list[str]:
    """The pools to render: ``keda_pools``, or every pool the workflows (built-in, entry
    points, ``workflow_modules``) route their steps to."""
    if settings.keda_pools.strip():
        return [p.strip() for p in settings.keda_pools.split(",") if p.strip()]
    registry = workflows if workflows is not None else load_workflows(settings)
    found = {step.pool or wf.pool for wf in registry.values() for step in wf.steps}
    return sorted(found)


def _labels(pool: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "calmq", "app.kubernetes.io/component": "worker",
            "calmq.dev/pool": pool}


def _deployment(settings: Settings, pool: str, name: str) -> dict[str, Any]:
    env: dict[str, str] = {
        "CALMQ_POOL": pool,
        "CALMQ_PRIORITIES": settings.priorities,
        "CALMQ_CONCURRENCY": str(settings.concurrency),
        "CALMQ_LEASE_SECONDS": f"{settings.lease_seconds:g}",
        "CALMQ_GRACE_SECONDS": f"{settings.grace_seconds:g}",
        "CALMQ_PROVIDER": settings.provider,
        "CALMQ_MODEL": settings.model,
        "CALMQ_LOG_LEVEL": settings.log_level,
    }
    for key, placeholder in _PLACEHOLDERS.items():
        env["CALMQ_" + key.upper()] = getattr(settings, key) or placeholder
    if settings.provider_url:
        env["CALMQ_PROVIDER_URL"] = settings.provider_url
    secrets = {"CALMQ_DATABASE_URL": "database-url", "CALMQ_PROVIDER_API_KEY": "provider-api-key"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": settings.keda_namespace, "labels": _labels(pool)},
        "spec": {
            # KEDA owns the replica count; this is only the count before KEDA first acts.
            "replicas": max(1, settings.keda_min_replicas),
            "selector": {"matchLabels": _labels(pool)},
            "template": {
                "metadata": {"labels": _labels(pool)},
                "spec": {
                    # Let in-flight jobs finish (grace_seconds) before the kill.
                    "terminationGracePeriodSeconds": math.ceil(settings.grace_seconds) + 5,
                    "containers": [{
                        "name": "worker",
                        "image": settings.keda_image,
                        "args": ["worker", "--metrics-port", "9100"],
                        "ports": [{"name": "metrics", "containerPort": 9100}],
                        "env": [{"name": k, "value": v} for k, v in sorted(env.items())]
                        + [{"name": k, "valueFrom": {"secretKeyRef": {"name": "calmq",
                                                                       "key": secret}}}
                           for k, secret in secrets.items()],
                    }],
                },
            },
        },
    }


def _scaled_object(settings: Settings, pool: str, name: str) -> dict[str, Any]:
    pool_topics = [topics.topic_for_route(topics.work_route(pool, p))
                   for p in settings.priority_list]
    partitions = len(pool_topics) * settings.topic_partitions
    budget = settings.budget_tokens_per_minute
    cap = (budget_cap(budget, settings.keda_tokens_per_job, settings.keda_seconds_per_call,
                      settings.concurrency) if budget else None)
    bootstrap = settings.kafka_bootstrap or _PLACEHOLDERS["kafka_bootstrap"]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {
            "name": name,
            "namespace": settings.keda_namespace,
            "labels": _labels(pool),
            # The inputs of maxReplicaCount, so a reader (and the test) can recompute it.
            "annotations": {
                "calmq.dev/partitions": str(partitions),
                "calmq.dev/concurrency": str(settings.concurrency),
                "calmq.dev/tokens-per-minute": str(budget),  # 0: no budget
                "calmq.dev/tokens-per-job": str(settings.keda_tokens_per_job),
                "calmq.dev/seconds-per-call": f"{settings.keda_seconds_per_call:g}",
                "calmq.dev/budget-busy-slots": f"{cap.busy_slots:.2f}" if cap else "none",
                "calmq.dev/budget-replica-cap": str(cap.replicas) if cap else "none",
            },
        },
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": settings.keda_min_replicas,
            "maxReplicaCount": min(partitions, cap.replicas) if cap else partitions,
            "pollingInterval": 15,
            # Slow jobs: wait long before scaling to zero, so a lull does not drop leases.
            "cooldownPeriod": 300,
            "triggers": [
                {
                    "type": "kafka",
                    "metadata": {
                        "bootstrapServers": bootstrap,
                        "consumerGroup": f"calmq.{pool}",  # the group processors/worker.py joins
                        "topic": topic,
                        "lagThreshold": str(settings.keda_lag_threshold),
                        "offsetResetPolicy": "earliest",
                        "allowIdleConsumers": "false",
                    },
                }
                for topic in pool_topics
            ],
        },
    }


def render(
    settings: Settings, workflows: dict[str, Workflow] | None = None
) -> dict[str, dict[str, Any]]:
    """``{file name: manifest}``: a Deployment and a ScaledObject per pool."""
    out: dict[str, dict[str, Any]] = {}
    for pool in pools(settings, workflows):
        name = f"calmq-worker-{pool}".replace("_", "-")
        out[f"worker-{pool}-deployment.yaml"] = _deployment(settings, pool, name)
        out[f"worker-{pool}-scaledobject.yaml"] = _scaled_object(settings, pool, name)
    return out


def write(settings: Settings, folder: Path) -> list[Path]:
    """Render into ``folder`` (created if missing); returns the files written."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, manifest in render(settings).items():
        path = folder / file_name
        header = "# Rendered by `calmq keda render`; edit the settings, not this file.\n"
        path.write_text(header + yaml.safe_dump(manifest, sort_keys=False), encoding="utf-8")
        written.append(path)
    return written
