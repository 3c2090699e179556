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

import pytest
import yaml

from calmq.errors import ConfigError
from calmq.settings import Settings, claimed_window
from calmq.tooling.keda import budget_cap, min_replicas, pool_scaling
from calmq.tooling.kubernetes import default_values, load_settings, render
from calmq.tooling.manifests import merge_values
from tests.unit.test_kubernetes import check_keda_auth

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


# Kafka security settings -> what KEDA's Kafka scaler gets: its trigger metadata, and the
# TriggerAuthentication's parameters by source (a Secret key or the worker's variable).
_MECHANISMS = {
    "scram over tls, private ca": (
        {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "SCRAM-SHA-512",
         "kafka_sasl_username": "calmq", "kafka_ssl_ca_location": "/x/ca.pem"},
        {"tls": "enable", "sasl": "scram_sha512"},
        {"password": ("calmq", "CALMQ_KAFKA_SASL_PASSWORD"), "ca": ("calmq", "kafka-ca.pem")},
        {"username": "CALMQ_KAFKA_SASL_USERNAME"}, None),
    "plain (confluent cloud), system ca": (
        {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "PLAIN",
         "kafka_sasl_username": "ABCDEFKEY"},
        {"tls": "enable", "sasl": "plaintext"},
        {"password": ("calmq", "CALMQ_KAFKA_SASL_PASSWORD")},
        {"username": "CALMQ_KAFKA_SASL_USERNAME"}, None),
    "scram without tls": (
        {"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "SCRAM-SHA-256",
         "kafka_sasl_username": "calmq"},
        {"sasl": "scram_sha256"},
        {"password": ("calmq", "CALMQ_KAFKA_SASL_PASSWORD")},
        {"username": "CALMQ_KAFKA_SASL_USERNAME"}, None),
    "oauthbearer oidc": (
        {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "OAUTHBEARER",
         "kafka_sasl_oauthbearer_token_endpoint_url": "https://idp.example/oauth2/token",
         "kafka_sasl_oauthbearer_client_id": "calmq", "kafka_sasl_oauthbearer_scope": "kafka",
         "kafka_sasl_oauthbearer_extensions": "logicalCluster=lkc-1,identityPoolId=pool-2"},
        {"tls": "enable", "sasl": "oauthbearer"},
        {"password": ("calmq", "CALMQ_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET")},
        {"username": "CALMQ_KAFKA_SASL_OAUTHBEARER_CLIENT_ID",
         "oauthTokenEndpointUri": "CALMQ_KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",
         "scopes": "CALMQ_KAFKA_SASL_OAUTHBEARER_SCOPE",
         "oauthExtensions": "CALMQ_KAFKA_SASL_OAUTHBEARER_EXTENSIONS"}, None),
    "msk iam": (
        {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "OAUTHBEARER",
         "kafka_sasl_oauthbearer_method": "aws_msk_iam",
         "kafka_sasl_oauthbearer_aws_region": "eu-west-1"},
        {"tls": "enable", "sasl": "oauthbearer", "saslTokenProvider": "aws_msk_iam",
         "awsRegion": "eu-west-1"},
        {}, {}, {"provider": "aws", "identityOwner": "workload"}),
    "mtls (strimzi)": (
        {"kafka_security_protocol": "SSL", "kafka_ssl_ca_location": "/x/ca.crt",
         "kafka_ssl_certificate_location": "/x/user.crt", "kafka_ssl_key_location": "/x/user.key"},
        {"tls": "enable"},
        {"ca": ("calmq", "kafka-ca.pem"), "cert": ("calmq", "kafka-client.pem"),
         "key": ("calmq", "kafka-client.key")}, {}, None),
}


def _secured(settings: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The full render (the ScaledObject's Secret keys are checked against the pods')."""
    loaded = Settings.load(environ={"CALMQ_" + k.upper(): v for k, v in settings.items()})
    return render(merge_values(default_values(loaded), PROVIDER))


@pytest.mark.parametrize("case", sorted(_MECHANISMS))
def test_keda_reads_the_lag_with_the_pods_credentials(case: str) -> None:
    """For each way into a secured Kafka, the trigger says tls and the sasl mode, and the
    pool's TriggerAuthentication gives KEDA's Kafka scaler every parameter it needs from the
    Secret keys and variables the workers use, which the scaler accepts."""
    settings, metadata, secrets, env, identity = _MECHANISMS[case]
    manifests = _secured(settings)
    [trigger] = manifests["60-worker-default-scaledobject.yaml"]["spec"]["triggers"]
    assert {k: v for k, v in trigger["metadata"].items()
            if k in ("tls", "sasl", "saslTokenProvider", "awsRegion")} == metadata
    assert trigger["authenticationRef"] == {"name": "calmq-worker-default"}
    spec = manifests["60-worker-default-triggerauthentication.yaml"]["spec"]
    assert {r["parameter"]: (r["name"], r["key"]) for r in spec.get("secretTargetRef", [])} \
        == secrets
    assert {r["parameter"]: r["name"] for r in spec.get("env", [])} == env
    assert spec.get("podIdentity") == identity
    assert check_keda_auth(list(manifests.values())) == 1


def test_tls_with_the_system_trust_store_needs_no_trigger_authentication() -> None:
    """A TLS listener signed by a public CA and no client authentication: the trigger says
    tls: enable, and no TriggerAuthentication is rendered or referenced."""
    manifests = _secured({"kafka_security_protocol": "SSL"})
    [trigger] = manifests["60-worker-default-scaledobject.yaml"]["spec"]["triggers"]
    assert trigger["metadata"]["tls"] == "enable"
    assert "authenticationRef" not in trigger
    assert "60-worker-default-triggerauthentication.yaml" not in manifests
    assert check_keda_auth(list(manifests.values())) == 0


def test_a_pools_own_trigger_authentication_replaces_calmqs() -> None:
    """A pool naming its own TriggerAuthentication gets no rendered one, and its trigger
    leaves tls and sasl to it (KEDA refuses them in both places); the other pools keep
    calmq's."""
    settings = Settings.load(environ={
        "CALMQ_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "CALMQ_KAFKA_SASL_MECHANISM": "PLAIN",
        "CALMQ_KAFKA_SASL_USERNAME": "u", "CALMQ_KEDA_POOLS": "default,gpu"})
    manifests = render(merge_values(default_values(settings), PROVIDER, {
        "workers": {"pools": {"gpu": {"keda": {"authenticationRef": "team-kafka"}}}}}))
    [own] = manifests["60-worker-gpu-scaledobject.yaml"]["spec"]["triggers"]
    assert own["authenticationRef"] == {"name": "team-kafka"}
    assert not {"tls", "sasl"} & set(own["metadata"])
    assert "60-worker-gpu-triggerauthentication.yaml" not in manifests
    assert "60-worker-default-triggerauthentication.yaml" in manifests
    assert check_keda_auth(list(manifests.values())) == 1


@pytest.mark.parametrize(("settings", "message"), [
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "SCRAM-SHA-512",
      "kafka_sasl_username": "calmq"}, "needs kafka_sasl_password"),
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "SCRAM-SHA-512"},
     "needs config.kafka_sasl_username"),
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "OAUTHBEARER",
      "kafka_sasl_oauthbearer_method": "aws_msk_iam"}, "kafka_sasl_oauthbearer_aws_region"),
])
def test_credentials_keda_cannot_read_are_a_clear_error(settings: dict[str, str],
                                                         message: str) -> None:
    """Values whose Kafka needs a credential KEDA would not find render nothing and say
    which value to set (a Secret for the password: a values file turned it off here)."""
    loaded = Settings.load(environ={"CALMQ_" + k.upper(): v for k, v in settings.items()})
    values = merge_values(default_values(loaded), PROVIDER,
                          {"secretSettings": {"kafka_sasl_password": {"secretName": ""}}})
    with pytest.raises(ConfigError, match=message):
        render(values)


def test_keda_reads_the_lag_of_the_prefixed_group_of_an_environment() -> None:
    """With name_prefix, the ScaledObject watches the group the pool's workers join."""
    settings = Settings.load(environ={"CALMQ_NAME_PREFIX": "staging."})
    [trigger] = _render(settings)["60-worker-default-scaledobject.yaml"]["spec"]["triggers"]
    assert trigger["metadata"]["consumerGroup"] == "staging.calmq.default"
