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

``lagThreshold`` is the worker's in-flight window (concurrency + an eighth, the jobs it
holds claimed and uncommitted), so a replica counts busy when that window is full, not when
one message waits (``lag_threshold``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calmq import topics
from calmq.errors import ConfigError
from calmq.settings import Settings, claimed_window
from calmq.workflows import Workflow, load_workflows

__all__ = ["PLACEHOLDERS", "BudgetCap", "budget_cap", "labels", "lag_threshold", "pools",
           "render", "scaled_object", "worker_name", "write"]

PLACEHOLDERS = {
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


def labels(pool: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "calmq", "app.kubernetes.io/component": "worker",
            "calmq.dev/pool": pool}


def worker_name(pool: str) -> str:
    return f"calmq-worker-{pool}".replace("_", "-")


def lag_threshold(settings: Settings) -> int:
    """Messages of lag per replica: the worker's in-flight window unless set.

    KEDA's lag counts every uncommitted offset, and a worker keeps its whole window
    (``claimed_window(concurrency)``) claimed but uncommitted while it runs. A threshold
    below the window counts one busy replica as several and sends the pool to its
    maximum; at the window, a replica counts busy exactly when its window is full.
    """
    return settings.keda_lag_threshold or claimed_window(settings.concurrency)


def scaled_object(settings: Settings, pool: str) -> dict[str, Any]:
    name = worker_name(pool)
    pool_topics = [topics.topic_for_route(topics.work_route(pool, p))
                   for p in settings.priority_list]
    partitions = len(pool_topics) * settings.topic_partitions
    budget = settings.budget_tokens_per_minute
    cap = (budget_cap(budget, settings.keda_tokens_per_job, settings.keda_seconds_per_call,
                      settings.concurrency) if budget else None)
    bootstrap = settings.kafka_bootstrap or PLACEHOLDERS["kafka_bootstrap"]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {
            "name": name,
            "namespace": settings.keda_namespace,
            "labels": labels(pool),
            # The inputs of maxReplicaCount, so a reader (and the test) can recompute it.
            "annotations": {
                "calmq.dev/partitions": str(partitions),
                "calmq.dev/concurrency": str(settings.concurrency),
                "calmq.dev/in-flight-window": str(claimed_window(settings.concurrency)),
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
            # KEDA reads cooldownPeriod only for the last step, 1 -> 0 replicas: how long
            # the pool must have had no lag before its last worker stops.
            "cooldownPeriod": 300,
            # Every other scale-down is the HPA's, paced here: a replica stopping waits for
            # its slowest step (terminationGracePeriodSeconds), so shed one at a time and
            # only after the lag has stayed low for five minutes.
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleDown": {"stabilizationWindowSeconds": 300,
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
                "scaleUp": {"stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Pods", "value": 4, "periodSeconds": 15}]},
            }}},
            "triggers": [
                {
                    "type": "kafka",
                    "metadata": {
                        "bootstrapServers": bootstrap,
                        "consumerGroup": f"calmq.{pool}",  # the group processors/worker.py joins
                        "topic": topic,
                        "lagThreshold": str(lag_threshold(settings)),
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
    """``{file name: manifest}``: the worker Deployment and ScaledObject of every pool, and
    the ConfigMap they read, exactly as `calmq k8s render` writes them."""
    from calmq.tooling import kubernetes

    registry = workflows if workflows is not None else load_workflows(settings)
    out: dict[str, dict[str, Any]] = {"configmap.yaml": kubernetes.configmap(settings)}
    for pool in pools(settings, registry):
        out[f"worker-{pool}-deployment.yaml"] = kubernetes.worker_deployment(
            settings, pool, registry)
        out[f"worker-{pool}-scaledobject.yaml"] = scaled_object(settings, pool)
    return out


def write(settings: Settings, folder: Path) -> list[Path]:
    """Render into ``folder`` (created if missing); returns the files written."""
    from calmq.tooling.kubernetes import dump

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, manifest in render(settings).items():
        path = folder / file_name
        path.write_text(dump(manifest, "calmq keda render"), encoding="utf-8")
        written.append(path)
    return written
