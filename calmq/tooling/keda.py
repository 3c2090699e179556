"""KEDA: per pool, the ScaledObject that scales the pool's workers on its consumer lag.

KEDA's Kafka scaler adds replicas while the pool's consumer group lags. As KEDA's
maintainers advise for a group that reads several topics, there is one trigger per pool,
without ``topic``: the scaler then sums the lag over every topic and partition the group
has committed offsets on (a trigger per topic would have the HPA take the largest of them,
not their sum). Two things bound how many replicas help (docs/how-to/autoscaling.md):

- partitions: a consumer without a partition is idle, so never more replicas than the
  partitions of the pool's topics (and ``allowIdleConsumers: false`` tells KEDA the same);
- the token budget: a replica runs ``concurrency`` model calls at once; by Little's law
  the budget keeps ``tokens_per_minute / tokens_per_job * seconds_per_call / 60`` calls in
  flight, so more replicas than that many slots only wait on 429s.

``maxReplicaCount = min(partition count, token-budget cap)``. The budget is
``budget_tokens_per_minute`` (the one the gateway enforces; 0 means none, and then the
partitions alone bound the fleet); tokens per job and seconds per call are the
``keda_*`` estimates. These are computed once, into the chart's values
(calmq/tooling/kubernetes.py: ``default_values``), where a reader sees the numbers.

``lagThreshold`` is the worker's in-flight window (concurrency + an eighth, the jobs it
holds claimed and uncommitted), so a replica counts busy when that window is full, not when
one message waits (``lag_threshold``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from calmq.errors import ConfigError
from calmq.settings import Settings, claimed_window
from calmq.tooling.manifests import Dashed, Key, Printf, Text, Val, When
from calmq.workflows import Workflow, load_workflows

__all__ = ["BudgetCap", "budget_cap", "lag_threshold", "min_replicas", "pool_scaling",
           "pools", "scaled_object", "worker_name"]


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


def min_replicas(settings: Settings) -> int:
    """``keda_min_replicas``, or 1 for a pool that takes interactive work (a person waits
    for it: never a cold start from zero) and 0 for a bulk-only pool."""
    if settings.keda_min_replicas is not None:
        return settings.keda_min_replicas
    return 1 if "interactive" in settings.priority_list else 0


def pool_scaling(settings: Settings) -> dict[str, Any]:
    """A pool's ``keda`` values, computed from the settings."""
    partitions = len(settings.priority_list) * settings.topic_partitions
    budget = settings.budget_tokens_per_minute
    cap = (budget_cap(budget, settings.keda_tokens_per_job, settings.keda_seconds_per_call,
                      settings.concurrency) if budget else None)
    most = min(partitions, cap.replicas) if cap else partitions
    least = min(min_replicas(settings), most)
    return {
        "enabled": True,
        "minReplicaCount": least,
        "maxReplicaCount": most,
        "lagThreshold": lag_threshold(settings),
        "pollingInterval": 15,
        # KEDA reads cooldownPeriod only for the last step, 1 -> 0 replicas: how long
        # the pool must have had no lag before its last worker stops.
        "cooldownPeriod": 300,
        # When KEDA cannot read the lag (Kafka away, bad credentials) this many times in a
        # row, it holds the pool at fallbackReplicas instead of guessing from nothing.
        "fallback": {"failureThreshold": 3, "replicas": max(least, min(2, most))},
        # A TriggerAuthentication's name, for a Kafka that needs SASL or TLS.
        "authenticationRef": "",
        # Every other scale-down is the HPA's, paced here: a replica stopping waits for
        # its slowest step (terminationGracePeriodSeconds), so shed one at a time and only
        # after the lag has stayed low for five minutes.
        "behavior": {
            "scaleDown": {"stabilizationWindowSeconds": 300,
                          "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
            "scaleUp": {"stabilizationWindowSeconds": 0,
                        "policies": [{"type": "Pods", "value": 4, "periodSeconds": 15}]},
        },
    }


def scaled_object(meta: Any) -> dict[str, Any]:
    """The ScaledObject of the pool bound to the scope ``pool`` (``meta`` makes its
    metadata); every number is the pool's ``keda`` value."""

    def pool(*path: str, block: bool = False) -> Val:
        return Val(("keda", *path), "pool", block=block)

    name = Printf("calmq-worker-%s", Dashed(Key("pool")))
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": pool("minReplicaCount"),
            "maxReplicaCount": pool("maxReplicaCount"),
            "pollingInterval": pool("pollingInterval"),
            "cooldownPeriod": pool("cooldownPeriod"),
            "fallback": {"failureThreshold": pool("fallback", "failureThreshold"),
                         "replicas": pool("fallback", "replicas")},
            "advanced": {"horizontalPodAutoscalerConfig": {
                "behavior": pool("behavior", block=True)}},
            "triggers": [{
                "type": "kafka",
                "metadata": {
                    "bootstrapServers": Text(Val(("config", "kafka_bootstrap"))),
                    # The group processors/worker.py joins; no topic: the lag of every
                    # topic the group reads (calmq.<pool>.interactive and .bulk), summed.
                    "consumerGroup": Printf("calmq.%s", Key("pool")),
                    "lagThreshold": Text(pool("lagThreshold")),
                    "offsetResetPolicy": "earliest",
                    "allowIdleConsumers": "false",
                },
                "authenticationRef": When(pool("authenticationRef"),
                                          {"name": pool("authenticationRef")}),
            }],
        },
    }
