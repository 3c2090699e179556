"""KEDA manifests in deploy/keda/ (`calmq k8s render --only workers`): their structure, their
replica cap, and what KEDA's own Kafka scaler makes of them.

``keda_replicas`` is KEDA's scaler logic as its source has it (pkg/scalers/kafka_scaler.go,
KEDA 2.16: ``getTotalLag`` and ``GetMetricsAndActivity``) followed by the HPA's
AverageValue rule: with no ``topic``, the lag of every partition of every topic the group
has offsets on is summed; with ``allowIdleConsumers: false`` the total is capped at
partitions x lagThreshold; the HPA asks for ceil(total / lagThreshold), bounded by
minReplicaCount and maxReplicaCount.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from calmq.settings import Settings, claimed_window
from calmq.tooling.keda import budget_cap, min_replicas, pool_scaling
from calmq.tooling.kubernetes import default_values, load_settings, render
from calmq.tooling.manifests import merge_values

ROOT = Path(__file__).resolve().parents[2]
KEDA = ROOT / "deploy" / "keda"
SETTINGS = ROOT / "deploy" / "kubernetes" / "settings.yaml"
PROVIDER = {"config": {"provider_url": "https://api.openai.com"}}


def _manifests(folder: Path) -> dict[str, dict[str, Any]]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(folder.glob("*.yaml"))}


def _pairs(manifests: dict[str, dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    deployments = {m["metadata"]["name"]: m
                   for m in manifests.values() if m["kind"] == "Deployment"}
    scaled = [m for m in manifests.values() if m["kind"] == "ScaledObject"]
    assert len(deployments) == len(scaled) == len(manifests) // 2  # nothing else: no ConfigMap
    return [(deployments[s["spec"]["scaleTargetRef"]["name"]], s) for s in scaled]


def _env(deployment: dict[str, Any]) -> dict[str, str]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"configMapRef": {"name": "calmq"}}]  # the full render's
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _render(settings: Settings) -> dict[str, dict[str, Any]]:
    return render(merge_values(default_values(settings), PROVIDER), only="workers")


def keda_replicas(scaled: dict[str, Any], lag: dict[tuple[str, int], int]) -> int:
    """The replicas KEDA (and the HPA it drives) settles on, given the lag of each (topic,
    partition) the group has offsets on: 0 with no lag at minReplicaCount 0 (KEDA
    deactivates the pool after its cooldown), otherwise the HPA's AverageValue rule."""
    spec = scaled["spec"]
    [trigger] = spec["triggers"]
    meta = trigger["metadata"]
    threshold = int(meta["lagThreshold"])
    topic = meta.get("topic")
    partitions = [(t, p) for t, p in lag if topic in (None, t)]
    total = sum(lag[tp] for tp in partitions)
    if meta.get("allowIdleConsumers", "false") == "false" and total // threshold > len(partitions):
        total = len(partitions) * threshold
    if total == 0 and spec["minReplicaCount"] == 0:
        return 0
    wanted = math.ceil(total / threshold)
    return max(spec["minReplicaCount"], min(spec["maxReplicaCount"], max(1, wanted)))


def test_committed_manifests_have_a_deployment_and_scaledobject_per_pool() -> None:
    """Each ScaledObject targets its pool's Deployment (without replicas) with one kafka
    trigger on the pool's group and no topic, so its lag is summed over the pool's topics."""
    pairs = _pairs(_manifests(KEDA))
    assert pairs, "deploy/keda/ holds no manifests"
    settings = load_settings(SETTINGS, environ={})
    for deployment, scaled in pairs:
        assert deployment["apiVersion"] == "apps/v1"
        assert "replicas" not in deployment["spec"]
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        env = _env(deployment)
        pool = env["CALMQ_POOL"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
        [trigger] = scaled["spec"]["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "kafka"
        assert "topic" not in meta
        assert meta["consumerGroup"] == f"calmq.{pool}"
        assert meta["bootstrapServers"] == "kafka:9092"  # the ConfigMap's (in-cluster name)
        assert meta["allowIdleConsumers"] == "false"
        # A replica counts busy when its whole in-flight window is uncommitted lag.
        assert meta["lagThreshold"] == str(claimed_window(int(env["CALMQ_CONCURRENCY"])))
        assert int(env["CALMQ_CONCURRENCY"]) == settings.concurrency
        fallback = scaled["spec"]["fallback"]
        assert fallback["failureThreshold"] >= 1
        assert 1 <= fallback["replicas"] <= scaled["spec"]["maxReplicaCount"]


def test_committed_max_replicas_is_min_of_partitions_and_budget_cap() -> None:
    """maxReplicaCount equals min(partitions, floor(budget's busy slots / concurrency))."""
    settings = load_settings(SETTINGS, environ={})
    assert settings.budget_tokens_per_minute > 0, "deploy/keda/ should show a budget cap"
    for deployment, scaled in _pairs(_manifests(KEDA)):
        concurrency = int(_env(deployment)["CALMQ_CONCURRENCY"])
        partitions = len(settings.priority_list) * settings.topic_partitions
        calls_in_flight = (settings.budget_tokens_per_minute / settings.keda_tokens_per_job
                           * settings.keda_seconds_per_call / 60)
        cap = max(1, math.floor(calls_in_flight / concurrency))
        assert scaled["spec"]["maxReplicaCount"] == min(partitions, cap)


def test_worked_example_of_the_docs() -> None:
    """2M tokens/min, 8,000 tokens/job, 10 s/call: 250 jobs/min, 41.67 busy slots, 5 x 8."""
    cap = budget_cap(2_000_000, 8_000, 10.0, concurrency=8)
    assert cap.jobs_per_minute == 250
    assert round(cap.busy_slots, 2) == 41.67
    assert cap.replicas == 5
    assert budget_cap(2_000_000, 8_000, 10.0, concurrency=256).replicas == 1  # never zero
    assert budget_cap(2_000_000, 8_000, 10.0, concurrency=1).replicas == 41


def test_partitions_cap_a_generous_budget() -> None:
    """With a budget that could feed 1000 replicas, partitions bound maxReplicaCount."""
    settings = Settings.load({"concurrency": 8, "budget_tokens_per_minute": 10**9}, environ={})
    scaled = _render(settings)["60-worker-default-scaledobject.yaml"]
    assert scaled["spec"]["maxReplicaCount"] == 2 * settings.topic_partitions


def test_no_budget_leaves_partitions_as_the_only_bound() -> None:
    """budget_tokens_per_minute 0 (no shared budget): maxReplicaCount is the partition count."""
    settings = Settings.load({"concurrency": 8}, environ={})
    scaled = _render(settings)["60-worker-default-scaledobject.yaml"]
    assert scaled["spec"]["maxReplicaCount"] == 2 * settings.topic_partitions


def test_lag_threshold_is_the_in_flight_window() -> None:
    """concurrency 8 -> 9 (8 slots + 1), 256 -> 288 (x 1.125); a set threshold wins."""
    for concurrency, window in ((8, 9), (256, 288), (1, 2)):
        settings = Settings.load({"concurrency": concurrency}, environ={})
        assert pool_scaling(settings)["lagThreshold"] == window
    settings = Settings.load({"keda_lag_threshold": 50}, environ={})
    [trigger] = _render(settings)["60-worker-default-scaledobject.yaml"]["spec"]["triggers"]
    assert trigger["metadata"]["lagThreshold"] == "50"


def test_interactive_pools_never_scale_to_zero_by_default() -> None:
    """minReplicaCount 1 where interactive work arrives (a person waits), 0 for a bulk-only
    pool; keda_min_replicas sets it for every pool."""
    assert min_replicas(Settings.load(environ={})) == 1
    assert min_replicas(Settings.load({"priorities": "bulk"}, environ={})) == 0
    assert min_replicas(Settings.load({"keda_min_replicas": 3}, environ={})) == 3
    scaled = _render(Settings.load(environ={}))["60-worker-default-scaledobject.yaml"]
    assert scaled["spec"]["minReplicaCount"] == 1


def test_kedas_scaler_sums_the_pools_topics_into_replicas() -> None:
    """KEDA's own logic on the committed ScaledObject: the lag of both priorities' topics
    is summed (a trigger per topic would have taken the larger), capped at the partitions
    and maxReplicaCount; the pool never goes below one replica."""
    [(deployment, scaled)] = _pairs(_manifests(KEDA))
    window = int(scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"])
    most = scaled["spec"]["maxReplicaCount"]
    pool = _env(deployment)["CALMQ_POOL"]
    interactive, bulk = f"calmq.{pool}.interactive", f"calmq.{pool}.bulk"
    # Two busy windows on each topic: four replicas' worth in all, not two.
    lag = {(interactive, 0): window, (interactive, 1): window,
           (bulk, 0): window, (bulk, 1): window}
    assert most >= 4
    assert keda_replicas(scaled, lag) == 4
    # The old shape, a trigger per topic: the HPA takes the largest metric, not the sum.
    per_topic = max(keda_replicas(_with_topic(scaled, t), lag) for t in (interactive, bulk))
    assert per_topic == 2
    # A flood on one partition: capped at the partitions the group reads, then at the max.
    assert keda_replicas(scaled, {(bulk, 0): 10**6, (bulk, 1): 0, (interactive, 0): 0}) == 3
    assert keda_replicas(scaled, {(bulk, p): 10**6 for p in range(16)}) == most
    # Nothing waits: the interactive pool keeps its one replica.
    assert keda_replicas(scaled, {(bulk, 0): 0, (interactive, 0): 0}) == 1


def _with_topic(scaled: dict[str, Any], topic: str) -> dict[str, Any]:
    out = yaml.safe_load(yaml.safe_dump(scaled))
    out["spec"]["triggers"][0]["metadata"]["topic"] = topic
    return out


def test_worker_window_is_the_one_keda_counts() -> None:
    """The worker bounds its consumer with the same window the threshold is derived from."""
    from calmq.processors.worker import _claimed_bound

    assert [_claimed_bound(c) for c in (1, 8, 256)] == [claimed_window(c) for c in (1, 8, 256)]
