"""The Prometheus Operator's PodMonitors and PrometheusRule (the alert rules as the
package ships them) and the Grafana dashboard's ConfigMap, each behind a value."""

from __future__ import annotations

import copy
from collections.abc import Callable
from importlib import resources
from typing import Any

from calmq.tooling.k8s.objects import _meta, _named, _root, _selector, _when_set
from calmq.tooling.manifests import (
    Check,
    Context,
    Doc,
    Fail,
    FileText,
    FullName,
    Not,
    Printf,
    Served,
    Spread,
    Val,
)


def _podmonitor(component: str) -> dict[Any, Any]:
    endpoint: dict[str, Any] = {"port": "metrics", "path": "/metrics",
                                "interval": _root("monitoring", "podMonitor", "interval")}
    if component in ("worker", "batcher"):
        # The pool as a target label, as the pod-annotation scrape config sets it.
        endpoint["relabelings"] = [{"sourceLabels": ["__meta_kubernetes_pod_label_calmq_dev_pool"],
                                    "targetLabel": "pool"}]
    meta = _meta(_named(component), component)
    meta["labels"][Spread(_root("monitoring", "podMonitor", "labels"))] = None
    return {
        Check(_operator_check("monitoring.podMonitor.enabled")): None,
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            # job="calmq-<part>", the same name the pod-annotation scrape config gives, so
            # the alert rules hold for either.
            "jobLabel": "calmq.dev/job",
            "selector": {"matchLabels": _selector(component)},
            "podMetricsEndpoints": [endpoint],
        },
    }


def _runbook(rule: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(rule)
    notes = out.get("annotations", {})
    if "runbook_url" in notes:
        notes["runbook_url"] = Printf(
            "%s%s", _root("monitoring", "prometheusRule", "runbookBaseUrl"),
            notes["runbook_url"])
    return out


_MONITORING_API = "monitoring.coreos.com/v1"


def _operator_check(value: str) -> Fail:
    return Fail(Not(Served(_MONITORING_API)),
                f"{value}: this cluster serves no {_MONITORING_API} (the Prometheus "
                "Operator's CRDs): install the operator, or set it false and scrape the "
                "pods' prometheus.io annotations (scrapeAnnotations)")


def _fixed(name: str) -> Callable[[Context], str]:
    return lambda _c: name


def _monitoring() -> list[Doc]:
    import yaml

    on = _root("monitoring", "podMonitor", "enabled")
    docs = [Doc(_fixed(f"70-podmonitor-{name}.yaml"), "podmonitors.yaml", _podmonitor(name),
                when=on)
            for name in ("api", "relay", "forwarder", "reaper", "worker", "batcher")]
    alerts = yaml.safe_load(monitoring_file("alerts.yml"))
    rule_meta = _meta(FullName(), "monitoring")
    rule_meta["labels"][Spread(_root("monitoring", "prometheusRule", "labels"))] = None
    docs.append(Doc(lambda _c: "71-prometheusrule.yaml", "prometheusrule.yaml", {
        Check(_operator_check("monitoring.prometheusRule.enabled")): None,
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
        "metadata": rule_meta,
        "spec": {"groups": [{**group, "rules": [_runbook(r) for r in group["rules"]]}
                            for group in alerts["groups"]]},
    }, when=_root("monitoring", "prometheusRule", "enabled")))
    dash = _root("monitoring", "dashboard")
    dash_meta = _meta(_named("dashboard"), "monitoring")
    dash_meta["labels"][Spread(Val((*dash.path, "labels")))] = None
    dash_meta["annotations"] = _when_set(Val((*dash.path, "annotations")), block=True)
    docs.append(Doc(lambda _c: "72-dashboard-configmap.yaml", "dashboard.yaml", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": dash_meta,
        "data": {"calmq.json": FileText("calmq-dashboard.json")},
    }, when=Val((*dash.path, "enabled"))))
    return docs


def monitoring_file(name: str) -> str:
    """The alert rules or the dashboard, as the package ships them (copies of
    deploy/prometheus/alerts.yml and deploy/grafana/calmq-dashboard.json)."""
    return resources.files("calmq.tooling").joinpath("monitoring", name).read_text("utf-8")

