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
CUSTOM = {"ScaledObject", "TriggerAuthentication", "PodMonitor", "PrometheusRule", "HTTPRoute"}
# The custom resources' APIs, as a cluster with KEDA and the Prometheus Operator serves them
# (helm template asks no cluster: it is told).
SERVED = ["--api-versions", "keda.sh/v1alpha1", "--api-versions", "monitoring.coreos.com/v1"]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}


def _run(argv: list[str], *, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=120, check=False)


@functools.cache
def helm_template(values: Path) -> list[dict[str, Any]]:
    done = _run([tool("helm"), "template", "calmq", str(CHART), "--namespace", NAMESPACE,
                 *SERVED, "--skip-tests", "-f", str(values)])
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
    done = _run([tool("helm"), "template", "calmq", str(CHART), *SERVED])
    assert done.returncode != 0
    assert "config.provider_url is required" in done.stderr


def test_helm_refuses_a_secret_in_a_plain_setting(tmp_path: Path) -> None:
    """`helm template` with a password in config.schema_registry_url fails naming it, as the
    renderer does: the ConfigMap never holds it."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"config": {
        "provider_url": "https://api.openai.com",
        "schema_registry_url": "https://calmq:hunter2@registry.example/apis/ccompat/v7"}}))
    done = _run([tool("helm"), "template", "calmq", str(CHART), *SERVED, "-f", str(values)])
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
    done = _run([tool("helm"), "template", "calmq", str(CHART), *SERVED, "-f", str(values)])
    assert done.returncode != 0
    assert "secretSettings.kafka_sasl_password" in done.stderr


def test_helm_lint_passes() -> None:
    """`helm lint` (the chart's metadata and templates) passes with the production set."""
    done = _run([tool("helm"), "lint", str(CHART), "-f", str(_set("production")),
                 "--set", "apiVersions={keda.sh/v1alpha1,monitoring.coreos.com/v1}"])
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


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    return _run([tool("helm"), "template", *args])


def _docs(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _pod_specs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"]
            for d in docs if d["kind"] in ("Deployment", "Job", "Pod")]


def test_two_releases_share_a_namespace_without_a_colliding_name() -> None:
    """Two releases of the production set in one namespace: no two objects share a kind
    and name, every object validates, and each release's selectors pick its own pods."""
    releases = {}
    for release in ("calmq-staging", "calmq-production"):
        releases[release] = _docs(_helm(release, str(CHART), "--namespace", NAMESPACE,
                                        *SERVED, "-f", str(_set("production")),
                                        "--set", "namespace.create=false"))
    _by_name(releases["calmq-staging"] + releases["calmq-production"])  # no shared name
    for release, docs in releases.items():
        _validate([d for d in docs if d["kind"] != "Pod"])
        for doc in docs:
            selector = (doc["spec"].get("selector") or {}) if doc["kind"] in (
                "Deployment", "Service", "PodDisruptionBudget") else {}
            labels = selector.get("matchLabels", selector)
            if labels:
                assert labels["app.kubernetes.io/instance"] == release, doc["metadata"]["name"]
            assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == release


def test_openshift_renders_no_fixed_ids() -> None:
    """openshift: true leaves runAsUser, runAsGroup and fsGroup to the restricted SCC in
    every pod and container, through helm and `calmq k8s render` alike; the default keeps
    the image's uid."""
    ids = {"runAsUser", "runAsGroup", "fsGroup"}
    shifted = _docs(_helm("calmq", str(CHART), *SERVED, "-f", str(_set("production")),
                          "--set", "openshift=true"))
    for spec in _pod_specs(shifted):
        assert not ids & set(spec["securityContext"]), spec["containers"][0]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for container in spec["containers"]:
            assert not ids & set(container["securityContext"])
    from calmq.settings import Settings
    from calmq.tooling.kubernetes import default_values, render
    from calmq.tooling.manifests import merge_values

    values = merge_values(default_values(Settings.load(environ={})),
                          {"config": {"provider_url": "https://api.openai.com"},
                           "openshift": True})
    for doc in render(values).values():
        if doc["kind"] in ("Deployment", "Job"):
            assert not ids & set(doc["spec"]["template"]["spec"]["securityContext"])
    default = _pod_specs(helm_template(_set("production")))
    assert all(spec["securityContext"]["runAsUser"] == 10001 for spec in default)


def test_keda_and_operator_objects_need_their_apis() -> None:
    """Without KEDA's API, a chart asked for ScaledObjects fails saying so, and renders
    none with KEDA off; the Prometheus Operator's objects likewise; with the APIs served
    they render."""
    minimal = str(_set("minimal"))
    refused = _helm("calmq", str(CHART), "-f", minimal)
    assert refused.returncode != 0
    assert "KEDA is enabled but this cluster serves no keda.sh/v1alpha1" in refused.stderr
    off = _docs(_helm("calmq", str(CHART), "-f", minimal,
                      "--set", "workers.poolDefaults.keda.enabled=false"))
    assert "ScaledObject" not in {d["kind"] for d in off}
    served = _docs(_helm("calmq", str(CHART), "-f", minimal, "--api-versions",
                         "keda.sh/v1alpha1"))
    assert "ScaledObject" in {d["kind"] for d in served}
    monitoring = _helm("calmq", str(CHART), "-f", minimal, "--api-versions",
                       "keda.sh/v1alpha1", "--set", "monitoring.podMonitor.enabled=true")
    assert monitoring.returncode != 0
    assert "monitoring.podMonitor.enabled: this cluster serves no monitoring.coreos.com/v1" \
        in monitoring.stderr


def test_api_pdb_only_above_one_replica_and_pool_pdbs_opt_in() -> None:
    """The API's PDB is rendered at two replicas and not at one (where it blocks every
    drain); a pool gets one only when it asks."""
    def kinds(*sets: str) -> set[tuple[str, str]]:
        docs = _docs(_helm("calmq", str(CHART), *SERVED, "-f", str(_set("minimal")),
                           *(a for s in sets for a in ("--set", s))))
        return {(d["kind"], d["metadata"]["name"]) for d in docs}

    assert ("PodDisruptionBudget", "calmq-api") in kinds("api.replicas=2")
    one = kinds("api.replicas=1")
    assert not [k for k in one if k[0] == "PodDisruptionBudget"]
    pooled = kinds("api.replicas=1", "workers.pools.default.pdb.enabled=true")
    assert [k for k in pooled if k[0] == "PodDisruptionBudget"] == [
        ("PodDisruptionBudget", "calmq-worker-default")]


def test_helm_test_pod_runs_calmq_health_against_the_release() -> None:
    """`helm test` runs a pod of `calmq health` with the release's settings and its API's
    address; `calmq k8s render` has no such pod."""
    docs = _docs(_helm("staging", str(CHART), *SERVED, "-f", str(_set("minimal"))))
    [pod] = [d for d in docs if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    [container] = pod["spec"]["containers"]
    assert container["command"] + container["args"] == ["calmq", "health"]
    assert {"name": "CALMQ_API_URL", "value": "http://staging-calmq-api:8080"} in \
        container["env"]
    assert container["envFrom"] == [{"configMapRef": {"name": "staging-calmq"}}]
    assert "Pod" not in {d["kind"] for d in calmq_render(_set("minimal"))}


def test_ingress_and_httproute_carry_upload_size_and_stream_timeouts(tmp_path: Path) -> None:
    """The Ingress carries ingress-nginx's body size (the upload limit and its form) and
    the SSE/Prefer: wait timeouts, unbuffered; the HTTPRoute its request timeouts and needs
    the Gateway API served; both give helm's and the render's same objects."""
    values = tmp_path / "routes.yaml"
    values.write_text(yaml.safe_dump({
        "config": {"provider_url": "https://api.openai.com"},
        "api": {"ingress": {"enabled": True, "host": "calmq.example.com",
                            "className": "nginx"},
                "httpRoute": {"enabled": True,
                              "parentRefs": [{"name": "edge", "namespace": "gateways"}]}}}))
    refused = _helm("calmq", str(CHART), *SERVED, "-f", str(values))
    assert "serves no gateway.networking.k8s.io/v1" in refused.stderr
    helm = _by_name(_docs(_helm("calmq", str(CHART), "--namespace", NAMESPACE, *SERVED,
                                "--skip-tests", "--api-versions",
                                "gateway.networking.k8s.io/v1", "-f", str(values))))
    assert helm == _by_name(calmq_render(values))
    notes = helm[("Ingress", "calmq-api")]["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-body-size"] == "101m"
    assert notes["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "3600"
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    [rule] = helm[("HTTPRoute", "calmq-api")]["spec"]["rules"]
    assert rule["timeouts"] == {"request": "3600s", "backendRequest": "3600s"}
    _validate([d for d in helm.values() if d["kind"] == "Ingress"])


def test_extra_volumes_containers_objects_and_a_job_without_its_hook(tmp_path: Path) -> None:
    """extraVolumes, extraVolumeMounts, initContainers and sidecars reach the part's pod,
    extraObjects are documents of their own, and jobs.migrate.hook false renders the
    migrate Job without hook annotations; helm and the render agree."""
    values = tmp_path / "extras.yaml"
    values.write_text(yaml.safe_dump({
        "config": {"provider_url": "https://api.openai.com"},
        "api": {"extraVolumes": [{"name": "certs", "configMap": {"name": "certs"}}],
                "extraVolumeMounts": [{"name": "certs", "mountPath": "/certs"}],
                "initContainers": [{"name": "wait", "image": "busybox", "args": ["true"]}],
                "sidecars": [{"name": "proxy", "image": "envoyproxy/envoy:v1.31"}]},
        "jobs": {"migrate": {"hook": False}},
        "extraObjects": [{"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": "certs"}, "data": {"ca.crt": "x"}}]}))
    helm = _by_name(_docs(_helm("calmq", str(CHART), "--namespace", NAMESPACE, *SERVED,
                                "--skip-tests", "-f", str(values))))
    assert helm == _by_name(calmq_render(values))
    pod = helm[("Deployment", "calmq-api")]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["api", "proxy"]
    assert [c["name"] for c in pod["initContainers"]] == ["wait"]
    assert {"name": "certs", "configMap": {"name": "certs"}} in pod["volumes"]
    assert {"name": "certs", "mountPath": "/certs"} in pod["containers"][0]["volumeMounts"]
    assert helm[("ConfigMap", "certs")]["data"] == {"ca.crt": "x"}
    migrate = helm[("Job", "calmq-migrate")]["metadata"].get("annotations") or {}
    assert not [k for k in migrate if "hook" in k]
    setup = helm[("Job", "calmq-kafka-setup")]["metadata"]["annotations"]
    assert setup["helm.sh/hook"] == "pre-install,pre-upgrade"
    _validate(list(helm.values()))
