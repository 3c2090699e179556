"""KEDA manifests in deploy/keda/: their structure, their replica cap, and their freshness."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from calmq.settings import Settings, claimed_window
from calmq.tooling.keda import budget_cap, render, write

KEDA = Path(__file__).resolve().parents[2] / "deploy" / "keda"

# The settings deploy/keda/ was rendered with (docs/how-to/autoscaling.md says the same).
RENDERED_WITH = {"concurrency": 8, "keda_pools": "default",
                 "budget_tokens_per_minute": 2_000_000}


def _manifests(folder: Path) -> dict[str, dict[str, Any]]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(folder.glob("*.yaml"))}


def _pairs(manifests: dict[str, dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    deployments = {m["metadata"]["name"]: m
                   for m in manifests.values() if m["kind"] == "Deployment"}
    scaled = [m for m in manifests.values() if m["kind"] == "ScaledObject"]
    assert len(deployments) == len(scaled) == (len(manifests) - 1) // 2  # and the ConfigMap
    return [(deployments[s["spec"]["scaleTargetRef"]["name"]], s) for s in scaled]


def _env(deployment: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: the ConfigMap, then env."""
    [config] = [m for m in _manifests(KEDA).values() if m["kind"] == "ConfigMap"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    refs = {next(iter(r.values()))["name"] for r in container["envFrom"]}
    assert refs == {config["metadata"]["name"]}  # the ConfigMap and the Secret, one name
    env = {**config["data"], "CALMQ_DATABASE_URL": "<secret>"}
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return env


def test_committed_manifests_have_a_deployment_and_scaledobject_per_pool() -> None:
    """Each ScaledObject targets its pool's Deployment with one kafka trigger per topic."""
    pairs = _pairs(_manifests(KEDA))
    assert pairs, "deploy/keda/ holds no manifests"
    for deployment, scaled in pairs:
        assert deployment["apiVersion"] == "apps/v1"
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        env = _env(deployment)
        pool = env["CALMQ_POOL"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
        topics = [f"calmq.{pool}.{p}" for p in env["CALMQ_PRIORITIES"].split(",")]
        triggers = scaled["spec"]["triggers"]
        assert [t["metadata"]["topic"] for t in triggers] == topics
        for trigger in triggers:
            meta = trigger["metadata"]
            assert trigger["type"] == "kafka"
            assert meta["consumerGroup"] == f"calmq.{pool}"
            assert meta["bootstrapServers"] == env["CALMQ_KAFKA_BOOTSTRAP"]
            assert meta["allowIdleConsumers"] == "false"
            # A replica counts busy when its whole in-flight window is uncommitted lag.
            assert meta["lagThreshold"] == str(claimed_window(int(env["CALMQ_CONCURRENCY"])))
        assert env["CALMQ_DATABASE_URL"] == "<secret>"  # never a password in a manifest
        # What the cap assumes is what the workers get: the same budget, in the ConfigMap.
        budget = scaled["metadata"]["annotations"]["calmq.dev/tokens-per-minute"]
        assert env["CALMQ_BUDGET_TOKENS_PER_MINUTE"] == budget


def test_committed_max_replicas_is_min_of_partitions_and_budget_cap() -> None:
    """maxReplicaCount equals min(partitions, floor(budget's busy slots / concurrency))."""
    for deployment, scaled in _pairs(_manifests(KEDA)):
        notes = scaled["metadata"]["annotations"]
        concurrency = int(_env(deployment)["CALMQ_CONCURRENCY"])
        assert int(notes["calmq.dev/concurrency"]) == concurrency
        partitions = len(scaled["spec"]["triggers"]) * Settings().topic_partitions
        assert int(notes["calmq.dev/partitions"]) == partitions
        budget = int(notes["calmq.dev/tokens-per-minute"])
        assert budget > 0, "deploy/keda/ should show a budget-capped fleet"
        calls_in_flight = (budget / int(notes["calmq.dev/tokens-per-job"])
                           * float(notes["calmq.dev/seconds-per-call"]) / 60)
        cap = max(1, math.floor(calls_in_flight / concurrency))
        assert int(notes["calmq.dev/budget-replica-cap"]) == cap
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
    settings = Settings.load({**RENDERED_WITH, "budget_tokens_per_minute": 10**9}, environ={})
    scaled = render(settings)["worker-default-scaledobject.yaml"]
    assert scaled["spec"]["maxReplicaCount"] == 2 * settings.topic_partitions


def test_no_budget_leaves_partitions_as_the_only_bound() -> None:
    """budget_tokens_per_minute 0 (no shared budget): maxReplicaCount is the partition count."""
    settings = Settings.load({**RENDERED_WITH, "budget_tokens_per_minute": 0}, environ={})
    scaled = render(settings)["worker-default-scaledobject.yaml"]
    assert scaled["spec"]["maxReplicaCount"] == 2 * settings.topic_partitions
    assert scaled["metadata"]["annotations"]["calmq.dev/budget-replica-cap"] == "none"


def test_committed_manifests_match_a_fresh_render(tmp_path: Path) -> None:
    """deploy/keda/ is what `calmq keda render` writes today (regenerate it if this fails)."""
    write(Settings.load(RENDERED_WITH, environ={}), tmp_path)
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.yaml")}
    committed = {p.name: p.read_text() for p in KEDA.glob("*.yaml")}
    assert fresh == committed


def test_lag_threshold_is_the_in_flight_window() -> None:
    """concurrency 8 -> 9 (8 slots + 1), 256 -> 288 (x 1.125); a set threshold wins."""
    for concurrency, window in ((8, 9), (256, 288), (1, 2)):
        settings = Settings.load({**RENDERED_WITH, "concurrency": concurrency}, environ={})
        triggers = render(settings)["worker-default-scaledobject.yaml"]["spec"]["triggers"]
        assert {t["metadata"]["lagThreshold"] for t in triggers} == {str(window)}
    settings = Settings.load({**RENDERED_WITH, "keda_lag_threshold": 50}, environ={})
    triggers = render(settings)["worker-default-scaledobject.yaml"]["spec"]["triggers"]
    assert {t["metadata"]["lagThreshold"] for t in triggers} == {"50"}


def test_worker_window_is_the_one_keda_counts() -> None:
    """The worker bounds its consumer with the same window the threshold is derived from."""
    from calmq.processors.worker import _claimed_bound

    assert [_claimed_bound(c) for c in (1, 8, 256)] == [claimed_window(c) for c in (1, 8, 256)]
