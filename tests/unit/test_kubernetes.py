"""deploy/kubernetes/: valid against Kubernetes' and KEDA's schemas, complete, and fresh.

The Kubernetes objects are checked with kubernetes-validate (PyPI; it bundles the OpenAPI
schemas of each release, so this runs offline) in strict mode, which also rejects fields
the schema does not know. The ScaledObject is a KEDA custom resource, which that schema does
not cover: it is checked against KEDA's documented spec and Kafka trigger metadata
(https://keda.sh/docs/2.16/reference/scaledobject-spec/ and
https://keda.sh/docs/2.16/scalers/apache-kafka/), and the HPA behaviour it hands to the
HorizontalPodAutoscaler KEDA creates is validated as that autoscaling/v2 object.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from calmq.settings import Settings, claimed_window
from calmq.tooling.kubernetes import (
    DRAIN_SECONDS,
    SECRET_KEYS,
    load_values,
    longest_step,
    render,
    write,
)
from calmq.workflows import load_workflows

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
VALUES = K8S / "values.yaml"
KUBERNETES_VERSION = kubernetes_validate.latest_version()


def _committed() -> dict[str, dict[str, Any]]:
    files = sorted(K8S.glob("*.yaml")) + sorted((K8S / "secret-template").glob("*.yaml"))
    return {str(p.relative_to(K8S)): yaml.safe_load(p.read_text()) for p in files
            if p.name != "values.yaml"}


def _kind(kind: str) -> list[dict[str, Any]]:
    return [m for m in _committed().values() if m["kind"] == kind]


def _pods() -> list[tuple[str, dict[str, Any]]]:
    """(object name, pod spec) of every Deployment and Job."""
    return [(m["metadata"]["name"], m["spec"]["template"]["spec"])
            for m in _committed().values() if m["kind"] in ("Deployment", "Job")]


def test_committed_manifests_match_a_fresh_render(tmp_path: Path) -> None:
    """deploy/kubernetes/ is what `calmq k8s render --values values.yaml` writes today."""
    write(load_values(VALUES, environ={}), tmp_path)
    fresh = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*.yaml")}
    committed = {str(p.relative_to(K8S)): p.read_text() for p in K8S.rglob("*.yaml")
                 if p.name != "values.yaml"}
    assert fresh == committed


def test_every_part_is_rendered() -> None:
    """API (Deployment, Service, PDB), relay, forwarder, reaper, workers, and both Jobs."""
    names = {(m["kind"], m["metadata"]["name"]) for m in _committed().values()}
    assert {("Deployment", "calmq-api"), ("Service", "calmq-api"),
            ("PodDisruptionBudget", "calmq-api"), ("Deployment", "calmq-relay"),
            ("Deployment", "calmq-forwarder"), ("Deployment", "calmq-reaper"),
            ("Deployment", "calmq-worker-default"), ("ScaledObject", "calmq-worker-default"),
            ("Job", "calmq-migrate"), ("Job", "calmq-kafka-setup"), ("ConfigMap", "calmq"),
            ("Secret", "calmq"), ("Namespace", "calmq")} <= names
    [migrate] = [m for m in _kind("Job") if m["metadata"]["name"] == "calmq-migrate"]
    [container] = migrate["spec"]["template"]["spec"]["containers"]
    assert container["command"] + container["args"] == ["calmq", "migrate"]


# The ScaledObject is KEDA's custom resource: test_scaled_objects_follow_kedas_spec checks it.
@pytest.mark.parametrize("name", sorted(n for n, m in _committed().items()
                                        if m["kind"] != "ScaledObject"))
def test_manifest_validates_against_the_kubernetes_schema(name: str) -> None:
    """Each Kubernetes object is valid (strict: no unknown fields) for a current release."""
    kubernetes_validate.validate(_committed()[name], KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_what_kubernetes_rejects() -> None:
    """The check is real: an unknown container field and a string replica count fail."""
    [api] = [m for m in _kind("Deployment") if m["metadata"]["name"] == "calmq-api"]
    bad = yaml.safe_load(yaml.safe_dump(api))
    bad["spec"]["template"]["spec"]["containers"][0]["enableServiceLinks"] = False
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(api))
    bad["spec"]["replicas"] = "2"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


# KEDA's documented fields (ScaledObject spec, Apache Kafka scaler), KEDA 2.16.
_SPEC_KEYS = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
              "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback",
              "advanced", "triggers"}
_ADVANCED_KEYS = {"restoreToOriginalReplicaCount", "horizontalPodAutoscalerConfig",
                  "scalingModifiers"}
_TRIGGER_KEYS = {"type", "metadata", "name", "useCachedMetrics", "authenticationRef",
                 "metricType"}
_KAFKA_REQUIRED = {"bootstrapServers", "consumerGroup"}
_KAFKA_KEYS = _KAFKA_REQUIRED | {
    "topic", "lagThreshold", "activationLagThreshold", "offsetResetPolicy",
    "allowIdleConsumers", "excludePersistentLag", "scaleToZeroOnInvalidOffset",
    "limitToPartitionsWithLag", "ensureEvenDistributionOfPartitions", "partitionLimitation",
    "version", "sasl", "tls", "unsafeSsl", "saslTokenProvider", "awsRegion",
    "bootstrapServersFromEnv", "consumerGroupFromEnv", "topicFromEnv"}
_KAFKA_BOOLS = {"allowIdleConsumers", "excludePersistentLag", "scaleToZeroOnInvalidOffset",
                "limitToPartitionsWithLag", "ensureEvenDistributionOfPartitions", "unsafeSsl"}


def test_scaled_objects_follow_kedas_spec() -> None:
    """Known spec keys, a Kafka trigger per topic with documented metadata, all strings."""
    scaled = _kind("ScaledObject")
    assert scaled
    deployments = {m["metadata"]["name"]: m for m in _kind("Deployment")}
    for so in scaled:
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        assert set(spec) <= _SPEC_KEYS
        assert set(spec["advanced"]) <= _ADVANCED_KEYS
        assert spec["scaleTargetRef"]["name"] in deployments
        for key in ("pollingInterval", "cooldownPeriod", "minReplicaCount", "maxReplicaCount"):
            assert isinstance(spec[key], int), key
            assert spec[key] >= 0, key
        assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
        for trigger in spec["triggers"]:
            assert set(trigger) <= _TRIGGER_KEYS
            assert trigger["type"] == "kafka"
            meta = trigger["metadata"]
            assert _KAFKA_REQUIRED <= set(meta) <= _KAFKA_KEYS, set(meta) - _KAFKA_KEYS
            # Trigger metadata is map[string]string: a bare number or boolean is rejected.
            assert all(isinstance(v, str) for v in meta.values()), meta
            assert meta["lagThreshold"].isdigit()
            assert int(meta["lagThreshold"]) > 0
            assert meta["offsetResetPolicy"] in ("earliest", "latest")
            assert all(meta[k] in ("true", "false") for k in _KAFKA_BOOLS & set(meta))


def test_hpa_behaviour_is_a_valid_autoscaling_v2_behavior() -> None:
    """The scale-down pacing KEDA copies into its HPA validates as that HPA would."""
    for so in _kind("ScaledObject"):
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
               "metadata": {"name": so["metadata"]["name"]},
               "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                           "name": so["spec"]["scaleTargetRef"]["name"]},
                        "minReplicas": 1, "maxReplicas": so["spec"]["maxReplicaCount"],
                        "behavior": behavior}}
        kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    """What the kubelet gives the container: ConfigMap, Secret, then its own env."""
    [config] = _kind("ConfigMap")
    [secret] = _kind("Secret")
    refs = [(k, v["name"]) for r in container["envFrom"] for k, v in r.items()]
    assert refs == [("configMapRef", config["metadata"]["name"]),
                    ("secretRef", secret["metadata"]["name"])]
    env = {**config["data"], **secret["stringData"]}
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return env


def test_every_container_gets_every_setting_and_they_load() -> None:
    """ConfigMap + Secret via envFrom in each container; the result is valid Settings."""
    for _name, pod in _pods():
        for container in pod["containers"]:
            Settings.load(environ=_container_env(container))  # unknown/invalid would raise


def test_workers_carry_the_budget_tiers_prices_and_workflows() -> None:
    """What the issue found missing reaches the workers: budget, tiers, price table."""
    values = yaml.safe_load(VALUES.read_text())
    for deployment in _kind("Deployment"):
        if deployment["metadata"]["labels"]["app.kubernetes.io/component"] != "worker":
            continue
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        env = _container_env(container)
        settings = Settings.load(environ=env)
        assert settings.budget_tokens_per_minute == values["budget_tokens_per_minute"]
        assert settings.retry_tiers == Settings().retry_tiers
        assert settings.prices["gpt-4o-mini"].output == values["prices"]["gpt-4o-mini"]["output"]
        assert settings.pool == deployment["metadata"]["labels"]["calmq.dev/pool"]


def test_a_workflow_module_reaches_its_pools(tmp_path: Path) -> None:
    """CALMQ_WORKFLOW_MODULES renders a worker per pool its workflows use, and reaches them."""
    settings = load_values(VALUES, {"CALMQ_WORKFLOW_MODULES": "tests.support.workflows"})
    manifests = render(settings)
    assert {"60-worker-wft-deployment.yaml", "60-worker-wft-ledger-deployment.yaml",
            "60-worker-wft-scaledobject.yaml"} <= set(manifests)
    data = manifests["10-configmap.yaml"]["data"]
    assert data["CALMQ_WORKFLOW_MODULES"] == "tests.support.workflows"


def test_secrets_never_reach_the_configmap() -> None:
    """The database URL and provider key are only in the Secret; the Secret has only them."""
    [config] = _kind("ConfigMap")
    [secret] = _kind("Secret")
    assert set(secret["stringData"]) == set(SECRET_KEYS)
    assert not set(config["data"]) & set(SECRET_KEYS)
    # The Secret is a template outside the applied folder: its placeholders are never applied.
    assert not list(K8S.glob("*secret*.yaml"))


def test_pods_are_hardened_and_take_no_service_links() -> None:
    """enableServiceLinks false, non-root, read-only root, ALL capabilities dropped."""
    for name, pod in _pods():
        assert pod["enableServiceLinks"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert set(container["resources"]) == {"requests", "limits"}, name


def test_probes_and_scrape_annotations_name_declared_ports() -> None:
    """Every long-running container is probed on a port it declares, and scraped there."""
    for deployment in _kind("Deployment"):
        template = deployment["spec"]["template"]
        [container] = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["port"] in ports, (deployment, probe)
        notes = template["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) in ports.values()
    [api] = [m for m in _kind("Deployment") if m["metadata"]["name"] == "calmq-api"]
    [container] = api["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_api_service_and_pdb_select_the_api_pods() -> None:
    """The Service and the PodDisruptionBudget select exactly the API Deployment's pods."""
    [api] = [m for m in _kind("Deployment") if m["metadata"]["name"] == "calmq-api"]
    labels = api["spec"]["template"]["metadata"]["labels"]
    [service] = _kind("Service")
    [pdb] = _kind("PodDisruptionBudget")
    assert service["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < api["spec"]["replicas"]


def test_relay_is_one_replica_recreated() -> None:
    """One relay owns the slot; Recreate never runs two during a rollout."""
    [relay] = [m for m in _kind("Deployment") if m["metadata"]["name"] == "calmq-relay"]
    assert relay["spec"]["replicas"] == 1
    assert relay["spec"]["strategy"] == {"type": "Recreate"}


def test_worker_grace_covers_the_longest_step_and_the_drain() -> None:
    """terminationGracePeriodSeconds >= the pool's longest step timeout + drain, and the
    worker's own grace period lets that step finish."""
    settings = load_values(VALUES, environ={})
    workflows = load_workflows(settings)
    for deployment in _kind("Deployment"):
        labels = deployment["metadata"]["labels"]
        if labels["app.kubernetes.io/component"] != "worker":
            continue
        pod = deployment["spec"]["template"]["spec"]
        longest = longest_step(settings, workflows, labels["calmq.dev/pool"])
        assert pod["terminationGracePeriodSeconds"] >= longest + DRAIN_SECONDS
        env = _container_env(pod["containers"][0])
        assert float(env["CALMQ_GRACE_SECONDS"]) >= longest
        assert pod["terminationGracePeriodSeconds"] >= float(env["CALMQ_GRACE_SECONDS"]) + 5


def test_scaled_object_signal_matches_the_workers() -> None:
    """lagThreshold = the worker's window; cap = min(partitions, budget cap) from the same
    settings the worker Deployment gets."""
    deployments = {m["metadata"]["name"]: m for m in _kind("Deployment")}
    for so in _kind("ScaledObject"):
        deployment = deployments[so["spec"]["scaleTargetRef"]["name"]]
        settings = Settings.load(
            environ=_container_env(deployment["spec"]["template"]["spec"]["containers"][0]))
        window = claimed_window(settings.concurrency)
        assert {t["metadata"]["lagThreshold"] for t in so["spec"]["triggers"]} == {str(window)}
        partitions = len(settings.priority_list) * settings.topic_partitions
        notes = so["metadata"]["annotations"]
        busy = (settings.budget_tokens_per_minute / int(notes["calmq.dev/tokens-per-job"])
                * float(notes["calmq.dev/seconds-per-call"]) / 60)
        cap = max(1, math.floor(busy / settings.concurrency))
        assert so["spec"]["maxReplicaCount"] == min(partitions, cap)
