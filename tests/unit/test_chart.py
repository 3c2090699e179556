"""The Helm chart (deploy/helm/calmq) and the Kustomize base (deploy/kubernetes), run by the
real tools: ``helm template`` for four value sets gives objects that pass strict
validation and equal what `calmq k8s render` gives for the same values, and ``kustomize
build`` of the base passes the same validation.

Helm and kustomize are built from their Go modules (`make helm kustomize`,
tests/support/k8s_tools.py). The value sets are tests/unit/chart_values/*.yaml: the least a
team sets, a production install with every option on (Strimzi mTLS among them), a cluster
without KEDA, and a SASL_SSL Kafka with a registry behind basic auth (secured).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.k8s_tools import tool
from tests.unit.test_kubernetes import check_keda_auth, check_scaled_object

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "calmq"
K8S = ROOT / "deploy" / "kubernetes"
VALUE_SETS = sorted((Path(__file__).parent / "chart_values").glob("*.yaml"))
KUBERNETES_VERSION = kubernetes_validate.latest_version()
NAMESPACE = "calmq"
# Custom resources the OpenAPI schema does not cover (test_kubernetes checks ScaledObjects
# and TriggerAuthentications against KEDA's spec, and the PodMonitor and PrometheusRule
# shapes).
CUSTOM = {"ScaledObject", "TriggerAuthentication", "PodMonitor", "PrometheusRule"}


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}


def _run(argv: list[str], *, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=120, check=False)


@functools.cache
def helm_template(values: Path) -> list[dict[str, Any]]:
    done = _run([tool("helm"), "template", "calmq", str(CHART), "--namespace", NAMESPACE,
                 "-f", str(values)])
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@functools.cache
def calmq_render(values: Path) -> list[dict[str, Any]]:
    done = _run([sys.executable, "-m", "calmq.cli", "k8s", "render", "--namespace", NAMESPACE,
                 "-f", str(values), "-o", "-"])
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _by_name(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(out) == len(docs), "two objects of one kind and name"
    return out


def _validate(docs: list[dict[str, Any]]) -> None:
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    for doc in docs:
        if doc["kind"] == "ScaledObject":
            check_scaled_object(doc, deployments)
        elif doc["kind"] not in CUSTOM:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    used = check_keda_auth(docs)
    assert used == sum(d["kind"] == "TriggerAuthentication" for d in docs)


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem)
def test_helm_template_passes_strict_validation(values: Path) -> None:
    """Every object `helm template` renders validates for a current Kubernetes release."""
    docs = helm_template(values)
    assert {"Deployment", "ConfigMap", "Job", "Service"} <= {d["kind"] for d in docs}
    _validate(docs)


@pytest.mark.parametrize("values", VALUE_SETS, ids=lambda p: p.stem)
def test_helm_template_equals_calmq_k8s_render(values: Path) -> None:
    """The chart and `calmq k8s render` give the same objects for the same values."""
    helm, calmq = _by_name(helm_template(values)), _by_name(calmq_render(values))
    assert sorted(helm) == sorted(calmq)
    for key, doc in calmq.items():
        assert helm[key] == doc, key


def test_the_value_sets_turn_on_what_they_say() -> None:
    """The production set renders the optional objects, the set without KEDA none of its
    objects, so the comparisons above cover every template."""
    production = {d["kind"] for d in helm_template(_set("production"))}
    assert {"Namespace", "ServiceAccount", "PodMonitor", "PrometheusRule", "NetworkPolicy",
            "ScaledObject", "TriggerAuthentication", "PodDisruptionBudget"} <= production
    secured = helm_template(_set("secured"))
    assert sorted(d["metadata"]["name"] for d in secured
                  if d["kind"] == "TriggerAuthentication") == ["calmq-worker-default"]
    without = helm_template(_set("without-keda"))
    assert not {"ScaledObject", "TriggerAuthentication", "ServiceAccount",
                "PodDisruptionBudget"} & {d["kind"] for d in without}
    workers = [d for d in without if d["metadata"]["name"].startswith("calmq-worker-")]
    assert sorted(d["spec"]["replicas"] for d in workers) == [1, 3]


def _set(name: str) -> Path:
    [found] = [p for p in VALUE_SETS if p.stem == name]
    return found


def test_helm_refuses_values_without_a_provider(tmp_path: Path) -> None:
    """`helm template` without config.provider_url fails with the reason, as the renderer
    does: a ConfigMap without the provider is never rendered."""
    done = _run([tool("helm"), "template", "calmq", str(CHART)])
    assert done.returncode != 0
    assert "config.provider_url is required" in done.stderr


def test_helm_refuses_a_secret_in_a_plain_setting(tmp_path: Path) -> None:
    """`helm template` with a password in config.schema_registry_url fails naming it, as the
    renderer does: the ConfigMap never holds it."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"config": {
        "provider_url": "https://api.openai.com",
        "schema_registry_url": "https://calmq:hunter2@registry.example/apis/ccompat/v7"}}))
    done = _run([tool("helm"), "template", "calmq", str(CHART), "-f", str(values)])
    assert done.returncode != 0
    assert "config.schema_registry_url holds a password" in done.stderr
    assert "hunter2" not in done.stdout


# The chart's KEDA helper (calmq.kedaKafkaAuth) against the renderer's kafka_auth, for the
# mechanisms the value sets above do not use.
_KEDA_CASES = {
    "oauthbearer-oidc": {
        "config": {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "OAUTHBEARER",
                   "kafka_sasl_oauthbearer_client_id": "calmq",
                   "kafka_sasl_oauthbearer_token_endpoint_url": "https://idp.example/token",
                   "kafka_sasl_oauthbearer_extensions": "logicalCluster=lkc-1"},
        "secretSettings": {"kafka_sasl_oauthbearer_client_secret": {
            "secretName": "oidc", "key": "client-secret"}}},
    "msk-iam": {
        "config": {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "OAUTHBEARER",
                   "kafka_sasl_oauthbearer_method": "aws_msk_iam",
                   "kafka_sasl_oauthbearer_aws_region": "eu-west-1"}},
    "password-as-a-file": {
        "config": {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "SCRAM-SHA-256",
                   "kafka_sasl_username": "calmq"},
        "secretSettings": {"kafka_sasl_password": {"secretName": ""}},
        "secretFiles": {"kafka_sasl_password": {"secretName": "calmq-kafka", "key": "password"}}},
    "username-from-a-secret": {
        "config": {"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "PLAIN"},
        "secretSettings": {"kafka_sasl_username": {"secretName": "cc", "key": "api-key"},
                           "kafka_sasl_password": {"secretName": "cc", "key": "api-secret"}}},
}


@pytest.mark.parametrize("case", sorted(_KEDA_CASES))
def test_helm_gives_keda_the_credentials_the_renderer_gives(case: str, tmp_path: Path) -> None:
    """For OAUTHBEARER (OIDC and MSK IAM), a username kept in a Secret and a password
    mounted as a file, `helm template` and `calmq k8s render` give the same objects, and
    KEDA's scaler takes them."""
    values = tmp_path / f"{case}.yaml"
    body = _KEDA_CASES[case]
    values.write_text(yaml.safe_dump({
        **body, "config": {"provider_url": "https://api.openai.com", **body["config"]}}))
    helm, calmq = _by_name(helm_template(values)), _by_name(calmq_render(values))
    assert helm == calmq
    assert ("TriggerAuthentication", "calmq-worker-default") in helm
    _validate(list(helm.values()))


def test_helm_refuses_kafka_credentials_keda_cannot_read(tmp_path: Path) -> None:
    """A SASL mechanism whose password has no Secret: `helm template` fails naming the value
    to set, as the renderer does."""
    values = tmp_path / "no-password.yaml"
    values.write_text(yaml.safe_dump({"config": {
        "provider_url": "https://api.openai.com", "kafka_security_protocol": "SASL_SSL",
        "kafka_sasl_mechanism": "SCRAM-SHA-512", "kafka_sasl_username": "calmq"}}))
    done = _run([tool("helm"), "template", "calmq", str(CHART), "-f", str(values)])
    assert done.returncode != 0
    assert "secretSettings.kafka_sasl_password" in done.stderr


def test_helm_lint_passes() -> None:
    """`helm lint` (the chart's metadata and templates) passes with the production set."""
    done = _run([tool("helm"), "lint", str(CHART), "-f", str(_set("production"))])
    assert done.returncode == 0, done.stdout + done.stderr


def test_kustomize_build_of_the_base_passes_strict_validation() -> None:
    """`kustomize build deploy/kubernetes`: every object validates, the ConfigMap carries a
    hash of its data in its name and every Deployment reads that name, the hook Jobs are
    included, the namespace and the image are Kustomize's to change."""
    done = _run([tool("kustomize"), "build", str(K8S)])
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    _validate(docs)
    [config] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config["metadata"]["name"].startswith("calmq-")
    assert {("Job", "calmq-migrate"), ("Job", "calmq-kafka-setup")} <= set(_by_name(docs))
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    [image] = kustomization["images"]
    for doc in docs:
        if doc.get("metadata", {}).get("namespace") is not None:
            assert doc["metadata"]["namespace"] == kustomization["namespace"]
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            assert container["envFrom"] == [
                {"configMapRef": {"name": config["metadata"]["name"]}}]
            assert container["image"] == f"{image['newName']}:{image['newTag']}"


# Three misspelt values that used to render with exit 0 and be ignored (issue 47).
_TYPOS = {
    "config.kafka_bootstap": {"config": {"kafka_bootstap": "kafka.prod:9092"}},
    "workers.pools.default.keda.minReplicas": {
        "workers": {"pools": {"default": {"keda": {"minReplicas": 2}}}}},
    "api.replica": {"api": {"replica": 3}},
}


@pytest.mark.parametrize("typo", sorted(_TYPOS))
def test_a_misspelt_value_fails_helm_and_calmq_k8s_render(typo: str, tmp_path: Path) -> None:
    """`helm template`, `helm install --dry-run` and `calmq k8s render` refuse a misspelt
    value, naming it, where they used to render and ignore it."""
    from calmq.tooling.manifests import merge_values

    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(merge_values(
        {"config": {"provider_url": "https://api.openai.com"}}, _TYPOS[typo])))
    *parent, key = typo.split(".")
    for argv in ([tool("helm"), "template", "calmq", str(CHART), "-f", str(values)],
                 [tool("helm"), "install", "calmq", str(CHART), "--dry-run=client",
                  "-f", str(values)]):
        done = _run(argv)
        assert done.returncode != 0, argv
        assert f"'/{'/'.join(parent)}'" in done.stderr
        assert f"'{key}'" in done.stderr
    done = _run([sys.executable, "-m", "calmq.cli", "k8s", "render", "-f", str(values),
                 "-o", "-"])
    assert done.returncode != 0
    assert f"{typo}: the chart has no value {key}" in done.stderr


def test_the_committed_values_schema_is_the_generated_one() -> None:
    """deploy/helm/calmq/values.schema.json is what Settings and the renderer's values give
    today (after a new setting or value: `make manifests`)."""
    from calmq.settings import Settings
    from calmq.tooling.kubernetes import default_values
    from calmq.tooling.values_schema import schema_text

    fresh = schema_text(default_values(Settings.load(environ={})))
    assert (CHART / "values.schema.json").read_text() == fresh, "run `make manifests`"
    schema = yaml.safe_load(fresh)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["config"]["additionalProperties"] is False
    assert "kafka_bootstrap" in schema["properties"]["config"]["properties"]
