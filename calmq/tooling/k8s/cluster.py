"""The release's own cluster objects: the Namespace, the ServiceAccount and the ConfigMap,
the NetworkPolicies, the `helm test` pod and ``extraObjects``."""

from __future__ import annotations

from typing import Any

from calmq.tooling.k8s.api import _API
from calmq.tooling.k8s.objects import (
    _NAME,
    _container,
    _meta,
    _named,
    _Part,
    _pod,
    _root,
    _selector,
    _when_set,
)
from calmq.tooling.k8s.secrets import NoSecrets
from calmq.tooling.manifests import (
    Check,
    Default,
    Doc,
    Entries,
    FullName,
    Key,
    Namespace,
    Printf,
    Release,
    Required,
    Spread,
    Text,
    Upper,
    Val,
    When,
)


def _network_policies() -> list[Doc]:
    """Who may reach the pods: the API port from ``apiFrom`` (anyone when empty), the
    metrics port from ``metricsFrom`` (the monitoring namespace, say) and the console's own
    port from ``consoleFrom``; the other parts take no traffic but scrapes."""
    net = ("networkPolicy",)

    def rule(port: str, peers: str) -> dict[str, Any]:
        return {"ports": [{"port": port, "protocol": "TCP"}],
                "from": _when_set(Val((*net, peers)), block=True)}

    def policy(name: Any, selector: dict[str, Any], rules: list[Any]) -> dict[str, Any]:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": _meta(name, "network-policy"),
                "spec": {"podSelector": selector, "policyTypes": ["Ingress"],
                         "ingress": rules}}

    api = policy(_named("api"), {"matchLabels": _selector("api")}, [
        rule("http", "apiFrom"), rule("metrics", "metricsFrom"),
        When(_API("console", "port"), rule("console", "consoleFrom"))])
    parts = policy(_named("parts"), {
        "matchLabels": {"app.kubernetes.io/name": _NAME, "app.kubernetes.io/instance": Release()},
        "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                              "values": ["relay", "forwarder", "reaper", "worker",
                                         "batcher"]}]}, [rule("metrics", "metricsFrom")])
    on = Val((*net, "enabled"))
    return [Doc(lambda _c: "80-networkpolicy-api.yaml", "networkpolicy.yaml", api, when=on),
            Doc(lambda _c: "80-networkpolicy-parts.yaml", "networkpolicy.yaml", parts,
                when=on)]


def _base() -> list[Doc]:
    ns_labels = {"app.kubernetes.io/name": "calmq", "app.kubernetes.io/component": "namespace",
                 # PodSecurity admission: every calmq pod meets the restricted profile.
                 "pod-security.kubernetes.io/enforce": _root("namespace", "podSecurity"),
                 "pod-security.kubernetes.io/audit": _root("namespace", "podSecurity"),
                 "pod-security.kubernetes.io/warn": _root("namespace", "podSecurity"),
                 Spread(_root("namespace", "labels")): None}
    account = _meta(Default(_root("serviceAccount", "name"), FullName()), "service-account")
    # For IRSA / Workload Identity: the cloud role that may read and write the bucket.
    account["annotations"] = _when_set(_root("serviceAccount", "annotations"), block=True)
    config_meta = _meta(FullName(), "config")
    # A ConfigMap without a provider is never rendered: every model call would fail.
    provider = Required(_root("config", "provider_url"),
                        "config.provider_url is required: the model provider's URL "
                        "(https://api.openai.com, https://api.anthropic.com, a vLLM or "
                        "LiteLLM address)")
    return [
        Doc(lambda _c: "00-namespace.yaml", "namespace.yaml",
            {"apiVersion": "v1", "kind": "Namespace",
             "metadata": {"name": Namespace(), "labels": ns_labels}},
            when=_root("namespace", "create")),
        Doc(lambda _c: "05-serviceaccount.yaml", "serviceaccount.yaml",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": account,
             "automountServiceAccountToken": False},
            when=_root("serviceAccount", "create")),
        Doc(lambda _c: "10-configmap.yaml", "configmap.yaml",
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": config_meta,
             "data": {Check(provider): None, Check(NoSecrets()): None,
                      Entries(_root("config"), "cfg", Printf("CALMQ_%s", Upper(Key("cfg"))),
                              Text(Val((), "cfg"))): None}}),
    ]


def _tests() -> list[Doc]:
    """`helm test`: a pod that runs `calmq health` against the release's own parts, with
    the settings and Secrets a worker has. The chart's alone: a Kustomize base would run
    it as a plain pod on every apply."""
    part = _Part("worker", ("jobs",))
    container = _container("health", ["health"], part, env=[
        {"name": "CALMQ_API_URL",
         "value": Printf("http://%s:%s", _named("api"), Text(_API("service", "port")))}])
    meta = _meta(_named("test"), "test")
    meta["annotations"] = {"helm.sh/hook": "test",
                           "helm.sh/hook-delete-policy": "before-hook-creation"}
    pod = _pod(part, [container], grace=5, restart="Never", component="worker")
    return [Doc(lambda _c: "90-test-pod.yaml", "tests/test-health.yaml",
                {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod},
                when=_root("tests", "enabled"), chart_only=True)]


def _extra_objects() -> list[Doc]:
    """``extraObjects``: any object of your own, each a document of the release."""
    return [Doc(lambda c: f"95-extra-{c.scopes['extra'].key}.yaml", "extra-objects.yaml",
                None, items=_root("extraObjects"))]
