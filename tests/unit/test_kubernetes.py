"""deploy/kubernetes/ (and deploy/keda/, deploy/helm/calmq): fresh, valid against Kubernetes'
and KEDA's schemas, complete, and safe to apply the GitOps way.

The Kubernetes objects are checked with kubernetes-validate (PyPI; it bundles the OpenAPI
schemas of each release, so this runs offline) in strict mode, which also rejects fields
the schema does not know. The ScaledObject is a KEDA custom resource, which that schema does
not cover: it is checked against KEDA's documented spec and Kafka trigger metadata
(https://keda.sh/docs/2.16/reference/scaledobject-spec/ and
https://keda.sh/docs/2.16/scalers/apache-kafka/), and the HPA behaviour it hands to the
HorizontalPodAutoscaler KEDA creates is validated as that autoscaling/v2 object.
tests/unit/test_chart.py holds the Helm chart and Kustomize's build to the same objects.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import SecretStr

from calmq.cli import main
from calmq.errors import ConfigError
from calmq.settings import Settings, claimed_window
from calmq.tooling.chart import chart
from calmq.tooling.kubernetes import (
    DRAIN_SECONDS,
    SECRET_FILES,
    SECRET_SETTINGS,
    default_values,
    dump,
    load_settings,
    longest_step,
    monitoring_file,
    render,
    secret_template,
    values_for,
    write,
)
from calmq.tooling.manifests import merge_values
from calmq.workflows import load_workflows
from tests.support.keda_auth import (
    check_trigger_authentication,
    parse_kafka_auth,
    resolve_auth_params,
)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
KEDA = ROOT / "deploy" / "keda"
CHART = ROOT / "deploy" / "helm" / "calmq"
SETTINGS = K8S / "settings.yaml"
VALUES = K8S / "values.yaml"
KUBERNETES_VERSION = kubernetes_validate.latest_version()
PROVIDER = {"config": {"provider_url": "https://api.openai.com"}}


def _settings() -> Settings:
    return load_settings(SETTINGS, environ={})


@functools.cache
def _committed() -> dict[str, dict[str, Any]]:
    """Every object of the folder (the hook Jobs in jobs/ too), by file name (read once:
    the tests do not change them)."""
    files = sorted(K8S.glob("*.yaml")) + sorted((K8S / "jobs").glob("*.yaml")) \
        + sorted((K8S / "secret-template").glob("*.yaml"))
    return {str(p.relative_to(K8S)): yaml.load(p.read_text(), Loader=yaml.CSafeLoader)
            for p in files
            if p.name not in ("settings.yaml", "values.yaml", "kustomization.yaml")}


def _kind(kind: str) -> list[dict[str, Any]]:
    return [m for m in _committed().values() if m["kind"] == kind]


def _pods() -> list[tuple[str, dict[str, Any]]]:
    """(object name, pod spec) of every Deployment and Job."""
    return [(m["metadata"]["name"], m["spec"]["template"]["spec"])
            for m in _committed().values() if m["kind"] in ("Deployment", "Job")]


def _texts(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*")
            if p.is_file() and p.name not in ("settings.yaml", "values.yaml")}


def test_committed_manifests_match_a_fresh_render(tmp_path: Path) -> None:
    """deploy/kubernetes/ and deploy/keda/ are what `make manifests` renders today."""
    values = values_for(_settings(), VALUES)
    write(values, tmp_path / "k8s")
    assert _texts(tmp_path / "k8s") == _texts(K8S)
    write(values_for(_settings()), tmp_path / "keda", only="workers")
    assert _texts(tmp_path / "keda") == _texts(KEDA)


def test_committed_chart_matches_a_fresh_one() -> None:
    """deploy/helm/calmq is what `calmq k8s chart` writes for the default settings, and the
    package's copies of the rules and the dashboard are deploy/'s files."""
    fresh = chart(default_values(Settings.load(environ={})))
    assert fresh == _texts(CHART) | {"values.yaml": (CHART / "values.yaml").read_text()}
    assert monitoring_file("alerts.yml") == (ROOT / "deploy/prometheus/alerts.yml").read_text()
    assert monitoring_file("calmq-dashboard.json") == \
        (ROOT / "deploy/grafana/calmq-dashboard.json").read_text()


def test_every_part_is_rendered() -> None:
    """API (Deployment, Service, PDB), relay, forwarder, reaper, workers, both Jobs."""
    names = {(m["kind"], m["metadata"]["name"]) for m in _committed().values()}
    assert {("Deployment", "calmq-api"), ("Service", "calmq-api"),
            ("PodDisruptionBudget", "calmq-api"), ("Deployment", "calmq-relay"),
            ("Deployment", "calmq-forwarder"), ("Deployment", "calmq-reaper"),
            ("Deployment", "calmq-worker-default"), ("ScaledObject", "calmq-worker-default"),
            ("Job", "calmq-migrate"), ("Job", "calmq-kafka-setup"), ("ConfigMap", "calmq"),
            ("Secret", "calmq"), ("Namespace", "calmq"), ("ServiceAccount", "calmq")} <= names
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


def check_scaled_object(so: dict[str, Any], deployments: dict[str, dict[str, Any]]) -> None:
    """A ScaledObject as KEDA's spec documents it, with one Kafka trigger for its pool."""
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert set(spec) <= _SPEC_KEYS
    assert set(spec["advanced"]) <= _ADVANCED_KEYS
    target = deployments[spec["scaleTargetRef"]["name"]]
    # KEDA owns the count: a replicas field would reset a busy pool on every sync.
    assert "replicas" not in target["spec"]
    for key in ("pollingInterval", "cooldownPeriod", "minReplicaCount", "maxReplicaCount"):
        assert isinstance(spec[key], int), key
        assert spec[key] >= 0, key
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    # fallback: held at these replicas when the lag cannot be read (AverageValue triggers).
    assert set(spec["fallback"]) == {"failureThreshold", "replicas"}
    assert spec["minReplicaCount"] <= spec["fallback"]["replicas"] <= spec["maxReplicaCount"]
    [trigger] = spec["triggers"]  # one per pool: lag summed over the group's topics
    assert set(trigger) <= _TRIGGER_KEYS
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    assert _KAFKA_REQUIRED <= set(meta) <= _KAFKA_KEYS, set(meta) - _KAFKA_KEYS
    assert "topic" not in meta
    # Trigger metadata is map[string]string: a bare number or boolean is rejected.
    assert all(isinstance(v, str) for v in meta.values()), meta
    assert meta["lagThreshold"].isdigit()
    assert int(meta["lagThreshold"]) > 0
    assert meta["offsetResetPolicy"] in ("earliest", "latest")
    assert all(meta[k] in ("true", "false") for k in _KAFKA_BOOLS & set(meta))


# The worker's variable each KEDA parameter must agree with (either, for password: the SASL
# password or, for OAUTHBEARER, the OAuth client's secret).
_SAME_AS = {"username": ("CALMQ_KAFKA_SASL_USERNAME", "CALMQ_KAFKA_SASL_OAUTHBEARER_CLIENT_ID"),
            "password": ("CALMQ_KAFKA_SASL_PASSWORD",
                         "CALMQ_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET"),
            "keyPassword": ("CALMQ_KAFKA_SSL_KEY_PASSWORD",),
            "ca": ("CALMQ_KAFKA_SSL_CA_LOCATION",),
            "cert": ("CALMQ_KAFKA_SSL_CERTIFICATE_LOCATION",),
            "key": ("CALMQ_KAFKA_SSL_KEY_LOCATION",),
            "oauthTokenEndpointUri": ("CALMQ_KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",),
            "scopes": ("CALMQ_KAFKA_SASL_OAUTHBEARER_SCOPE",),
            "oauthExtensions": ("CALMQ_KAFKA_SASL_OAUTHBEARER_EXTENSIONS",)}


def pod_sources(pod: dict[str, Any], container: dict[str, Any], config: dict[str, str]
                ) -> dict[str, tuple[str, Any]]:
    """Where each of the container's variables comes from, as the kubelet gives it:
    ("value", text) from the ConfigMap or the env, ("secret", (Secret, key)) from a
    secretKeyRef, ("file", (Secret, key)) for a value that is the path of a file a Secret
    volume mounts."""
    files: dict[str, tuple[str, str]] = {}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        for item in secret["items"]:
            files[f"{mount['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"])
    out: dict[str, tuple[str, Any]] = {}
    if container.get("envFrom"):
        out.update({k: ("value", v) for k, v in config.items()})
    for item in container.get("env", []):
        if "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            out[item["name"]] = ("secret", (ref["name"], ref["key"]))
        elif item["value"] in files:
            out[item["name"]] = ("file", files[item["value"]])
        else:
            out[item["name"]] = ("value", item["value"])
    return out


def check_keda_auth(docs: list[dict[str, Any]]) -> int:
    """Every ScaledObject whose Kafka needs credentials gets them as KEDA's Kafka scaler
    accepts them, from the same Secret keys and variables as its workers: each
    ``secretTargetRef`` is the (Secret, key) the worker reads the setting from (the
    variable, or the file it mounts), each ``env`` a variable the worker has. Returns how
    many ScaledObjects use a TriggerAuthentication calmq rendered."""
    auths = {d["metadata"]["name"]: d for d in docs if d["kind"] == "TriggerAuthentication"}
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    config = next((d["data"] for d in docs if d["kind"] == "ConfigMap"
                   and d["metadata"]["name"].startswith("calmq")
                   and "CALMQ_PROVIDER_URL" in d.get("data", {})), {})
    used = 0
    for so in (d for d in docs if d["kind"] == "ScaledObject"):
        [trigger] = so["spec"]["triggers"]
        ref = (trigger.get("authenticationRef") or {}).get("name")
        deployment = deployments[so["spec"]["scaleTargetRef"]["name"]]
        pod = deployment["spec"]["template"]["spec"]
        [worker] = [c for c in pod["containers"] if c["name"] == "worker"]
        sources = pod_sources(pod, worker, config)
        protocol = dict(sources).get("CALMQ_KAFKA_SECURITY_PROTOCOL", ("value", "PLAINTEXT"))[1]
        if ref is not None and ref not in auths:
            # A TriggerAuthentication of the team's own: it says tls and sasl itself.
            assert not {"tls", "sasl"} & set(trigger["metadata"]), so["metadata"]["name"]
            continue
        spec: dict[str, Any] = {}
        if ref is not None:
            used += 1
            ta = auths[ref]
            check_trigger_authentication(ta)
            assert ta["metadata"]["namespace"] == so["metadata"]["namespace"]
            spec = ta["spec"]
        for item in spec.get("secretTargetRef", []):
            names = _SAME_AS[item["parameter"]]
            wanted = {sources.get(v) for v in (*names, *(n + "_FILE" for n in names))}
            assert {("secret", (item["name"], item["key"])),
                    ("file", (item["name"], item["key"]))} & wanted, (ref, item)
        env = {k: v[1] for k, v in sources.items() if v[0] == "value"}
        for item in spec.get("env", []):
            assert item.get("containerName") == "worker", item
            assert item["name"] in _SAME_AS[item["parameter"]], item
            assert env.get(item["name"]), (ref, item)  # KEDA resolves it from the worker
        # What KEDA's operator then hands its Kafka scaler, which takes it.
        secrets = {(i["name"], i["key"]): f"{i['name']}/{i['key']}"
                   for i in spec.get("secretTargetRef", [])}
        params = resolve_auth_params(spec, secrets, {"worker": env})
        parsed = parse_kafka_auth(trigger["metadata"], params, spec.get("podIdentity"))
        assert parsed.tls is (protocol in ("SSL", "SASL_SSL")), ref
        assert (parsed.sasl != "none") is protocol.startswith("SASL_"), ref
    return used


def test_scaled_objects_follow_kedas_spec() -> None:
    """Known spec keys, one Kafka trigger without a topic, fallback, string metadata, and a
    target Deployment without replicas."""
    scaled = _kind("ScaledObject")
    assert scaled
    deployments = {m["metadata"]["name"]: m for m in _kind("Deployment")}
    for so in scaled:
        check_scaled_object(so, deployments)


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


def container_env(container: dict[str, Any], config: dict[str, str],
                  secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """What the kubelet gives the container: envFrom the ConfigMap, then its env in order
    (a secretKeyRef read from ``secrets`` by (Secret, key))."""
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        assert ref == {"configMapRef": {"name": "calmq"}}, ref
        env.update(config)
    for item in container.get("env", []):
        if "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            env[item["name"]] = item["value"]
    return env


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    [config] = [m for m in _kind("ConfigMap") if m["metadata"]["name"] == "calmq"]
    [secret] = _kind("Secret")
    secrets = {("calmq", k): v for k, v in secret["stringData"].items()}
    return container_env(container, config["data"], secrets)


def test_every_container_gets_every_setting_and_they_load() -> None:
    """ConfigMap (Jobs: inline) and secretKeyRefs; the result is valid Settings."""
    for _name, pod in _pods():
        for container in pod["containers"]:
            env = _container_env(container)
            assert env["CALMQ_PROVIDER_URL"] == "https://api.openai.com"
            Settings.load(environ={**env, "CALMQ_STRICT_SETTINGS": "true"})


def test_workers_carry_the_budget_tiers_prices_and_workflows() -> None:
    """What the workers need reaches them: budget, tiers, price table, their pool."""
    settings = yaml.safe_load(SETTINGS.read_text())
    for deployment in _kind("Deployment"):
        if deployment["metadata"]["labels"]["app.kubernetes.io/component"] != "worker":
            continue
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        loaded = Settings.load(environ=_container_env(container))
        assert loaded.budget_tokens_per_minute == settings["budget_tokens_per_minute"]
        assert loaded.retry_tiers == Settings().retry_tiers
        assert loaded.prices["gpt-4o-mini"].output == settings["prices"]["gpt-4o-mini"]["output"]
        assert loaded.pool == deployment["metadata"]["labels"]["calmq.dev/pool"]
        assert loaded.concurrency == settings["concurrency"]


def test_a_workflow_module_reaches_its_pools() -> None:
    """CALMQ_WORKFLOW_MODULES gives a worker per pool its workflows use, and reaches them."""
    settings = load_settings(SETTINGS, {"CALMQ_WORKFLOW_MODULES": "tests.support.workflows"})
    manifests = render(merge_values(default_values(settings), PROVIDER))
    assert {"60-worker-wft-deployment.yaml", "60-worker-wft-ledger-deployment.yaml",
            "60-worker-wft-scaledobject.yaml"} <= set(manifests)
    data = manifests["10-configmap.yaml"]["data"]
    assert data["CALMQ_WORKFLOW_MODULES"] == "tests.support.workflows"


def test_the_configmap_holds_only_what_was_set() -> None:
    """The settings file's values and the in-cluster addresses; no default is frozen (a
    default changed by an upgrade arrives, a setting a release renames does not linger)."""
    [config] = [m for m in _kind("ConfigMap") if m["metadata"]["name"] == "calmq"]
    written = {"CALMQ_" + k.upper() for k in yaml.safe_load(SETTINGS.read_text())}
    addresses = {"CALMQ_KAFKA_BOOTSTRAP", "CALMQ_SCHEMA_REGISTRY_URL", "CALMQ_OBJECT_STORE_URL"}
    # concurrency is each pool's (its container's env), not the ConfigMap's.
    assert set(config["data"]) == (written - {"CALMQ_CONCURRENCY"}) | addresses
    assert "CALMQ_RETRY_TIERS" not in config["data"]


def test_no_provider_no_configmap() -> None:
    """Values without config.provider_url render nothing: a ConfigMap without the provider
    would turn every model call into a failure."""
    with pytest.raises(ConfigError, match="provider_url is required"):
        render(default_values(Settings.load(environ={})))


def test_secrets_are_read_by_key_and_never_reach_the_configmap() -> None:
    """The database URL and the provider key come from secretKeyRefs only; the Secret's
    template holds the keys those read; the provider key only reaches the parts that call
    the provider; the template is outside the applied folder."""
    [config] = [m for m in _kind("ConfigMap") if m["metadata"]["name"] == "calmq"]
    [secret] = _kind("Secret")
    assert set(secret["stringData"]) == {"CALMQ_DATABASE_URL", "CALMQ_PROVIDER_API_KEY"}
    assert not set(config["data"]) & set(secret["stringData"])
    for name, pod in _pods():
        for container in pod["containers"]:
            refs = {e["name"] for e in container["env"] if "valueFrom" in e}
            assert "CALMQ_DATABASE_URL" in refs, name
            calls = container["name"] in ("worker", "batcher")
            assert ("CALMQ_PROVIDER_API_KEY" in refs) is calls, name
    assert not list(K8S.glob("*secret*.yaml"))


_SECRET_IN_PLAIN_SETTINGS = {  # setting -> a value of it that carries a secret
    "schema_registry_url": "https://calmq:hunter2-registry@registry.example/apis/ccompat/v7",
    "provider_extra_headers": '{"X-Team": "search", "Authorization": "Bearer hunter2-hdr"}',
    "embeddings_extra_headers": '{"api-key": "hunter2-emb"}',
    "kafka_config": '{"ssl.keystore.password": "hunter2-kafka", "linger.ms": 5}',
}


@pytest.mark.parametrize("name", sorted(_SECRET_IN_PLAIN_SETTINGS))
def test_a_secret_in_a_plain_setting_is_refused_not_rendered(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A password in the registry URL's userinfo, a credential among the extra headers, or a
    librdkafka password in kafka_config, from the settings or from a values file: the render
    refuses, naming the setting, and writes nothing (no ConfigMap, no hook Job's env)."""
    value = _SECRET_IN_PLAIN_SETTINGS[name]
    settings = load_settings(SETTINGS, environ={f"CALMQ_{name.upper()}": value})
    for values in (default_values(settings),
                   merge_values(default_values(_settings()), {"config": {
                       name: json.loads(value) if value.startswith("{") else value}})):
        for only in (None, "workers"):
            with pytest.raises(ConfigError) as refused:
                render(values, only=only)
            assert refused.value.code == "secret_in_config"
            assert f"config.{name}" in refused.value.message
            assert "hunter2" not in refused.value.message
    out = tmp_path / "k8s"
    monkeypatch.setenv(f"CALMQ_{name.upper()}", value)
    assert main(["k8s", "render", "--settings", str(SETTINGS), "-o", str(out)]) != 0
    assert not any("hunter2" in p.read_text() for p in out.rglob("*") if p.is_file())


def test_plain_settings_without_secrets_still_render() -> None:
    """A registry URL with a user and no password, plain extra headers and kafka_config
    without a secret are written to the ConfigMap as before."""
    settings = load_settings(SETTINGS, environ={
        "CALMQ_SCHEMA_REGISTRY_URL": "https://registry.example/apis/ccompat/v7",
        "CALMQ_PROVIDER_EXTRA_HEADERS": '{"X-Team": "search"}',
        "CALMQ_KAFKA_CONFIG": '{"linger.ms": 5, "socket.keepalive.enable": true}'})
    [config] = [m for m in render(default_values(settings)).values()
                if m["kind"] == "ConfigMap" and m["metadata"]["name"] == "calmq"]
    assert config["data"]["CALMQ_PROVIDER_EXTRA_HEADERS"] == '{"X-Team":"search"}'
    assert "linger.ms" in config["data"]["CALMQ_KAFKA_CONFIG"]


def test_role_urls_come_from_their_own_secrets_to_their_own_parts() -> None:
    """migrate_database_url reaches the migrate Job alone, relay_database_url the relay
    alone, each from the Secret and key the values name (an operator's Secret as it is)."""
    values = merge_values(default_values(Settings.load(environ={})), PROVIDER, {
        "secretSettings": {
            "database_url": {"secretName": "pg-app", "key": "uri"},
            "migrate_database_url": {"secretName": "pg-superuser", "key": "uri"},
            "relay_database_url": {"secretName": "pg-replication", "key": "uri"}}})
    seen: dict[str, dict[str, tuple[str, str]]] = {}
    for manifest in render(values).values():
        if manifest["kind"] not in ("Deployment", "Job"):
            continue
        for c in manifest["spec"]["template"]["spec"]["containers"]:
            seen[c["name"]] = {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"],
                                           e["valueFrom"]["secretKeyRef"]["key"])
                               for e in c["env"] if "valueFrom" in e}
    assert seen["migrate"]["CALMQ_MIGRATE_DATABASE_URL"] == ("pg-superuser", "uri")
    assert seen["relay"]["CALMQ_RELAY_DATABASE_URL"] == ("pg-replication", "uri")
    assert seen["api"]["CALMQ_DATABASE_URL"] == ("pg-app", "uri")
    for name, refs in seen.items():
        assert ("CALMQ_MIGRATE_DATABASE_URL" in refs) is (name == "migrate"), name
        assert ("CALMQ_RELAY_DATABASE_URL" in refs) is (name == "relay"), name
    loaded = Settings.load(environ={"CALMQ_DATABASE_URL": "postgresql://app@db/calmq"})
    assert loaded.effective_migrate_database_url == "postgresql://app@db/calmq"
    assert loaded.effective_relay_database_url == "postgresql://app@db/calmq"


def _secured_render(tmp_path: Path, **extra: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values, manifests) of `calmq k8s render` with the secured stack's settings: a
    SASL_SSL broker (SCRAM-SHA-512, a private CA) and a registry with basic auth over HTTPS,
    the passwords in files as a shell holding them would give them."""
    (tmp_path / "kafka-password").write_text("s3cret-kafka-pw")
    (tmp_path / "registry-password").write_text("s3cret-registry-pw")
    environ = {
        "CALMQ_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "CALMQ_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "CALMQ_KAFKA_SASL_USERNAME": "calmq",
        "CALMQ_KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "kafka-password"),
        "CALMQ_KAFKA_SSL_CA_LOCATION": str(tmp_path / "ca.pem"),
        "CALMQ_SCHEMA_REGISTRY_URL": "https://registry.example.internal/apis/ccompat/v7",
        "CALMQ_SCHEMA_REGISTRY_USERNAME": "calmq",
        "CALMQ_SCHEMA_REGISTRY_PASSWORD_FILE": str(tmp_path / "registry-password"),
        "CALMQ_SCHEMA_REGISTRY_CA_LOCATION": str(tmp_path / "ca.pem"), **extra}
    values = merge_values(default_values(load_settings(SETTINGS, environ)), PROVIDER)
    return values, render(values)


def _containers(manifests: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every Deployment and Job."""
    return [(m["spec"]["template"]["spec"], c) for m in manifests.values()
            if m["kind"] in ("Deployment", "Job")
            for c in m["spec"]["template"]["spec"]["containers"]]


def test_credentials_reach_their_parts_from_the_secret_never_the_configmap(
        tmp_path: Path) -> None:
    """With Kafka and registry credentials set, the ConfigMap holds no secret and no local
    path; the passwords are secretKeyRefs and the CA a file mounted from the Secret, each
    in the parts that use it (the Kafka ones not in migrate or the reaper, the registry's
    not in the API); the Secret's template lists exactly those keys; no value set at render
    time reaches a rendered file; every container's environment loads."""
    values, manifests = _secured_render(tmp_path)
    data = manifests["10-configmap.yaml"]["data"]
    assert data["CALMQ_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert data["CALMQ_KAFKA_SASL_USERNAME"] == "calmq"
    assert not {k for k in data if "PASSWORD" in k or k.endswith("_LOCATION")}
    text = "".join(dump(m, "t") for m in manifests.values())
    assert "s3cret" not in text
    assert str(tmp_path) not in text
    template = secret_template(values, "calmq")
    assert set(template["stringData"]) == {
        "CALMQ_DATABASE_URL", "CALMQ_PROVIDER_API_KEY", "CALMQ_KAFKA_SASL_PASSWORD",
        "CALMQ_SCHEMA_REGISTRY_PASSWORD", "kafka-ca.pem", "registry-ca.pem"}
    read: set[tuple[str, str]] = set()
    for pod, container in _containers(manifests):
        sources = pod_sources(pod, container, data)
        read |= {v[1] for v in sources.values() if v[0] in ("secret", "file")}
        part = container["name"].split("-")[0]
        kafka = part in ("api", "relay", "forwarder", "worker", "batcher", "topics", "schemas")
        registry = part in ("relay", "forwarder", "worker", "batcher", "topics", "schemas")
        assert (sources.get("CALMQ_KAFKA_SASL_PASSWORD") ==
                ("secret", ("calmq", "CALMQ_KAFKA_SASL_PASSWORD"))) is kafka, part
        assert (sources.get("CALMQ_KAFKA_SSL_CA_LOCATION") ==
                ("file", ("calmq", "kafka-ca.pem"))) is kafka, part
        assert (sources.get("CALMQ_SCHEMA_REGISTRY_PASSWORD") ==
                ("secret", ("calmq", "CALMQ_SCHEMA_REGISTRY_PASSWORD"))) is registry, part
        assert (sources.get("CALMQ_SCHEMA_REGISTRY_CA_LOCATION") ==
                ("file", ("calmq", "registry-ca.pem"))) is registry, part
        for mount in container["volumeMounts"]:
            if mount["name"] != "tmp":
                assert mount["readOnly"] is True
        env = container_env(container, data, dict.fromkeys(
            (("calmq", n) for n in template["stringData"]), "x"))
        Settings.load(environ={**env, "CALMQ_STRICT_SETTINGS": "true"})
    assert read == {("calmq", k) for k in template["stringData"]}
    for pod, _container in _containers(manifests):
        for volume in pod["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] == 0o440  # the pod's group, no one else


def test_a_secret_setting_can_come_as_a_file_instead(tmp_path: Path) -> None:
    """A secret setting in secretFiles (here the SASL password, from Strimzi's KafkaUser
    Secret) is mounted and named by its CALMQ_<NAME>_FILE variable, so its value never
    enters the environment: calmq reads it from the file, and KEDA from the same key."""
    values = merge_values(default_values(Settings.load(environ={})), PROVIDER, {
        "config": {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "SCRAM-SHA-512",
                   "kafka_sasl_username": "calmq"},
        "secretFiles": {"kafka_sasl_password": {"secretName": "calmq-kafka", "key": "password",
                                                "parts": ["worker"]}}})
    manifests = render(values)
    pod = manifests["60-worker-default-deployment.yaml"]["spec"]["template"]["spec"]
    [worker] = pod["containers"]
    data = manifests["10-configmap.yaml"]["data"]
    sources = pod_sources(pod, worker, data)
    assert sources["CALMQ_KAFKA_SASL_PASSWORD_FILE"] == ("file", ("calmq-kafka", "password"))
    assert "CALMQ_KAFKA_SASL_PASSWORD" not in sources
    path = next(e["value"] for e in worker["env"]
                if e["name"] == "CALMQ_KAFKA_SASL_PASSWORD_FILE")
    local = tmp_path / "password"
    local.write_text("from-the-file\n")  # a key written with echo: one newline
    env = container_env(worker, data, {("calmq", "CALMQ_DATABASE_URL"): "postgresql://x/y",
                                       ("calmq", "CALMQ_PROVIDER_API_KEY"): "k"})
    env["CALMQ_KAFKA_SASL_PASSWORD_FILE"] = str(local)  # the mount, here
    loaded = Settings.load(environ=env)
    assert loaded.kafka_sasl_password.get_secret_value() == "from-the-file"
    assert path == "/etc/calmq/secrets/kafka-sasl-password/password"
    [ref] = manifests["60-worker-default-triggerauthentication.yaml"]["spec"]["secretTargetRef"]
    assert ref == {"parameter": "password", "name": "calmq-kafka", "key": "password"}
    assert check_keda_auth(list(manifests.values())) == 1
    relay = manifests["40-relay-deployment.yaml"]["spec"]["template"]["spec"]
    assert [v["name"] for v in relay["volumes"]] == ["tmp"]  # parts: the worker alone


def test_every_secret_and_file_setting_has_its_place() -> None:
    """Each setting that holds a secret (a SecretStr, a database URL) is a secretSettings
    entry and each that names a file (``*_location``) a secretFiles entry, so none can
    reach the ConfigMap when set."""
    fields = Settings.model_fields
    secrets = {n for n, f in fields.items()
               if f.annotation is SecretStr or n.endswith("database_url")}
    assert secrets == set(SECRET_SETTINGS)
    assert {n for n in fields if n.endswith("_location")} == set(SECRET_FILES)
    keys = [key for key, _parts in SECRET_FILES.values()]
    assert len(set(keys)) == len(keys)  # one Secret holds them all by default


def test_pods_are_hardened_and_take_no_service_links() -> None:
    """enableServiceLinks false, non-root, read-only root, ALL capabilities dropped, and
    the namespace enforces PodSecurity restricted."""
    for name, pod in _pods():
        assert pod["enableServiceLinks"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert set(container["resources"]) == {"requests", "limits"}, name
    [namespace] = _kind("Namespace")
    labels = namespace["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"


def test_probes_scrape_annotations_and_job_labels_name_declared_ports() -> None:
    """Every long-running container is probed on a port it declares and scraped there,
    and its pod carries calmq.dev/job = calmq-<part>, the job name the alert rules use."""
    for deployment in _kind("Deployment"):
        template = deployment["spec"]["template"]
        [container] = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["port"] in ports, (deployment, probe)
        notes = template["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == ports["metrics"]
        labels = template["metadata"]["labels"]
        assert labels["calmq.dev/job"] == "calmq-" + labels["app.kubernetes.io/component"]
    [api] = [m for m in _kind("Deployment") if m["metadata"]["name"] == "calmq-api"]
    [container] = api["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CALMQ_API_METRICS_PORT"] == "9100"


def test_podmonitors_take_the_job_and_pool_labels_the_rules_use() -> None:
    """monitoring.podMonitor: one PodMonitor per part, jobLabel calmq.dev/job (the pods'
    label), the pool as a target label for workers; the PrometheusRule carries every rule
    with its runbook under the base URL; the dashboard ConfigMap has the sidecar's label."""
    values = merge_values(default_values(Settings.load(environ={})), PROVIDER, {
        "monitoring": {"podMonitor": {"enabled": True},
                       "prometheusRule": {"enabled": True,
                                          "runbookBaseUrl": "https://docs.example.com/"},
                       "dashboard": {"enabled": True}}})
    manifests = render(values)
    monitors = [m for m in manifests.values() if m["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {
        f"calmq-{p}" for p in ("api", "relay", "forwarder", "reaper", "worker", "batcher")}
    for monitor in monitors:
        part = monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        assert monitor["spec"]["jobLabel"] == "calmq.dev/job"
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["port"] == "metrics"
        pool = [r for r in endpoint.get("relabelings", []) if r["targetLabel"] == "pool"]
        assert bool(pool) is (part in ("worker", "batcher"))
    [rule] = [m for m in manifests.values() if m["kind"] == "PrometheusRule"]
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    rendered = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert [r["alert"] for r in rendered] == [r["alert"] for g in alerts["groups"]
                                              for r in g["rules"]]
    for r in rendered:
        assert r["annotations"]["runbook_url"].startswith(
            "https://docs.example.com/docs/how-to/troubleshooting.md#")
    [dashboard] = [m for m in manifests.values() if m["metadata"]["name"] == "calmq-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["calmq.json"] == monitoring_file("calmq-dashboard.json")


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


def test_jobs_are_hooks_outside_the_applied_folder() -> None:
    """The migrate and Kafka setup Jobs: Helm pre-install/pre-upgrade and Argo CD PreSync
    hooks, deleted before the next is created, migrate first; in jobs/, which `kubectl apply
    -f deploy/kubernetes/` does not descend into; their settings inline (no ConfigMap
    exists yet when a hook runs)."""
    jobs = {m["metadata"]["name"]: m for m in _kind("Job")}
    assert set(jobs) == {"calmq-migrate", "calmq-kafka-setup"}
    assert not [p for p in K8S.glob("*.yaml")
                if yaml.safe_load(p.read_text()).get("kind") == "Job"]
    for job in jobs.values():
        notes = job["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert notes["helm.sh/hook-delete-policy"] == "before-hook-creation"
        assert notes["argocd.argoproj.io/hook"] == "PreSync"
        assert notes["argocd.argoproj.io/hook-delete-policy"] == "BeforeHookCreation"
        for container in job["spec"]["template"]["spec"]["containers"]:
            assert "envFrom" not in container
        assert "serviceAccountName" not in job["spec"]["template"]["spec"]
    weights = {n: int(j["metadata"]["annotations"]["helm.sh/hook-weight"])
               for n, j in jobs.items()}
    assert weights["calmq-migrate"] < weights["calmq-kafka-setup"]


def test_a_config_change_rolls_every_pod_and_nothing_else_does() -> None:
    """checksum/config changes with any ConfigMap value and with secretsVersion (rotate a
    Secret, bump it), and stays when an unrelated value changes."""
    base = merge_values(default_values(Settings.load(environ={})), PROVIDER)

    def sums(values: dict[str, Any]) -> set[str]:
        return {m["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for m in render(values).values() if m["kind"] == "Deployment"}

    [first] = sums(base)
    assert sums(merge_values(base, {"api": {"replicas": 5}})) == {first}
    [changed] = sums(merge_values(base, {"config": {"model": "gpt-4.1-mini"}}))
    [rotated] = sums(merge_values(base, {"secretsVersion": "2"}))
    assert len({first, changed, rotated}) == 3


def test_worker_grace_covers_the_longest_step_and_the_drain() -> None:
    """terminationGracePeriodSeconds >= the pool's longest step timeout + drain, and the
    worker's own grace period lets that step finish."""
    settings = _settings()
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
    settings the worker Deployment gets; minReplicaCount 1 for an interactive pool."""
    settings = _settings()
    deployments = {m["metadata"]["name"]: m for m in _kind("Deployment")}
    for so in _kind("ScaledObject"):
        deployment = deployments[so["spec"]["scaleTargetRef"]["name"]]
        loaded = Settings.load(
            environ=_container_env(deployment["spec"]["template"]["spec"]["containers"][0]))
        window = claimed_window(loaded.concurrency)
        assert {t["metadata"]["lagThreshold"] for t in so["spec"]["triggers"]} == {str(window)}
        partitions = len(loaded.priority_list) * loaded.topic_partitions
        busy = (loaded.budget_tokens_per_minute / settings.keda_tokens_per_job
                * settings.keda_seconds_per_call / 60)
        cap = max(1, math.floor(busy / loaded.concurrency))
        assert so["spec"]["maxReplicaCount"] == min(partitions, cap)
        assert so["spec"]["minReplicaCount"] == (1 if "interactive" in loaded.priority_list
                                                 else 0)


def _cli(argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> int:
    for key in [k for k in __import__("os").environ if k.startswith("CALMQ_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("CALMQ_DATA_DIR", str(tmp_path / "no-stack"))
    return main(argv)


def test_render_to_stdout_is_one_yaml_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """`calmq k8s render -o -` prints every object as multi-document YAML, writes no
    folder named -, and equals the folder's render."""
    monkeypatch.chdir(tmp_path)
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(PROVIDER))
    assert _cli(["k8s", "render", "-f", str(values), "-o", "-"], monkeypatch, tmp_path) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert not (tmp_path / "-").exists()
    expected = render(merge_values(default_values(Settings.load(environ={})), PROVIDER))
    assert docs == list(expected.values())


def test_only_workers_writes_workers_and_their_scaled_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--only workers` (and the old `calmq keda render`, which runs it) writes each pool's
    Deployment and ScaledObject and never a ConfigMap of its own."""
    out = tmp_path / "workers"
    assert _cli(["k8s", "render", "--only", "workers", "--keda-pools", "ocr,default",
                 "-o", str(out)], monkeypatch, tmp_path) == 0
    assert sorted(p.name for p in out.glob("*.yaml")) == [
        "60-worker-default-deployment.yaml", "60-worker-default-scaledobject.yaml",
        "60-worker-ocr-deployment.yaml", "60-worker-ocr-scaledobject.yaml"]
    old = tmp_path / "keda"
    assert _cli(["keda", "render", "--output-dir", str(old)], monkeypatch, tmp_path) == 0
    assert {yaml.safe_load(p.read_text())["kind"] for p in old.glob("*.yaml")} == {
        "Deployment", "ScaledObject"}


def test_k8s_render_with_credentials_writes_references_and_the_trigger_authentication(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`calmq k8s render` from settings that use credentials (and were given none): the
    pods' Secret references, the Secret's template with their keys, each pool's
    TriggerAuthentication in the folder, the Kustomize base and the workers' subset."""
    settings = tmp_path / "settings.yaml"
    settings.write_text(yaml.safe_dump({
        "provider_url": "https://api.openai.com", "kafka_security_protocol": "SASL_SSL",
        "kafka_sasl_mechanism": "SCRAM-SHA-512", "kafka_sasl_username": "calmq",
        "kafka_ssl_ca_location": "ca.pem", "schema_registry_username": "calmq"}))
    out = tmp_path / "out"
    assert _cli(["k8s", "render", "--settings", str(settings), "-o", str(out)], monkeypatch,
                tmp_path) == 0
    secret = yaml.safe_load((out / "secret-template" / "calmq-secret.yaml").read_text())
    assert set(secret["stringData"]) == {
        "CALMQ_DATABASE_URL", "CALMQ_PROVIDER_API_KEY", "CALMQ_KAFKA_SASL_PASSWORD",
        "CALMQ_SCHEMA_REGISTRY_PASSWORD", "kafka-ca.pem"}
    auth = yaml.safe_load((out / "60-worker-default-triggerauthentication.yaml").read_text())
    assert auth["kind"] == "TriggerAuthentication"
    base = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert "60-worker-default-triggerauthentication.yaml" in base["resources"]
    docs = [yaml.safe_load(p.read_text()) for p in sorted(out.rglob("*.yaml"))
            if p.name != "kustomization.yaml" and "secret-template" not in str(p)]
    assert check_keda_auth(docs) == 1
    workers = tmp_path / "workers"
    assert _cli(["k8s", "render", "--only", "workers", "--settings", str(settings),
                 "-o", str(workers)], monkeypatch, tmp_path) == 0
    assert (workers / "60-worker-default-triggerauthentication.yaml").is_file()


def test_a_settings_file_is_not_taken_for_values(tmp_path: Path) -> None:
    """A values file that names settings at its top is refused with the way out."""
    wrong = tmp_path / "values.yaml"
    wrong.write_text("provider_url: https://api.openai.com\n")
    with pytest.raises(ConfigError, match="under config:"):
        values_for(Settings.load(environ={}), wrong)


def test_an_unknown_configmap_setting_warns_in_a_pod_and_fails_in_a_shell(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CALMQ_STRICT_SETTINGS=false (every rendered container sets it): a setting the image
    does not know (a ConfigMap a release ahead) is a warning; in a shell, an error."""
    env = {"CALMQ_RENAMED_LATER": "1", "CALMQ_MODEL": "m"}
    with pytest.raises(ConfigError, match="CALMQ_RENAMED_LATER"):
        Settings.load(environ=env)
    with caplog.at_level(logging.WARNING, logger="calmq.settings"):
        loaded = Settings.load(environ={**env, "CALMQ_STRICT_SETTINGS": "false"})
    assert loaded.model == "m"
    assert "CALMQ_RENAMED_LATER" in caplog.text
    for name, pod in _pods():
        for container in pod["containers"]:
            strict = [e for e in container["env"] if e["name"] == "CALMQ_STRICT_SETTINGS"]
            assert strict == [{"name": "CALMQ_STRICT_SETTINGS", "value": "false"}], name


def test_the_consumer_examples_variables_and_the_old_image_name_are_no_errors() -> None:
    """The CALMQ_ names examples/consumers read are no unknown settings; CALMQ_KEDA_IMAGE
    still sets the image, for one release."""
    env = {"CALMQ_CONSUMER_GROUP": "g", "CALMQ_TENANT_ID": "t", "CALMQ_MAX_MESSAGES": "1",
           "CALMQ_IDLE_TIMEOUT": "3", "CALMQ_KEDA_IMAGE": "registry.example.com/calmq:1.2.3"}
    assert Settings.load(environ=env).image == "registry.example.com/calmq:1.2.3"
    image = default_values(Settings.load(environ=env))["image"]
    assert (image["repository"], image["tag"]) == ("registry.example.com/calmq", "1.2.3")


def test_worker_and_batcher_refuse_to_start_without_a_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Outside the local stack, no provider URL is a clear error before anything starts."""
    for name in ("CALMQ_PROVIDER_URL", "CALMQ_FAKE_PROVIDER_URL"):
        monkeypatch.delenv(name, raising=False)
    for command in ("worker", "batcher"):
        monkeypatch.setenv("CALMQ_DATABASE_URL", "postgresql://calmq@127.0.0.1:1/calmq")
        monkeypatch.setenv("CALMQ_KAFKA_BOOTSTRAP", "127.0.0.1:1")
        code = main([command, "--data-dir", str(tmp_path / "no-stack")])
        err = capsys.readouterr().err
        assert code == 1, err
        assert "[no_provider]" in err
        assert "CALMQ_PROVIDER_URL" in err
