"""KEDA manifests in deploy/keda/: their structure, their replica cap, and their freshness."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from calmq.settings import Settings
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
    assert len(deployments) == len(scaled) == len(manifests) // 2
    return [(deployments[s["spec"]["scaleTargetRef"]["name"]], s) for s in scaled]


def _env(deployment: dict[str, Any]) -> dict[str, str]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", "<secret>") for e in container["env"]}


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
            assert int(meta["lagThreshold"]) >= 1
        assert env["CALMQ_DATABASE_URL"] == "<secret>"  # never a password in a manifest


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
