"""The Helm chart deploy/helm/calmq, written from the one renderer (calmq/tooling/kubernetes.py).

``write_chart`` writes ``Chart.yaml``, ``values.yaml`` (``default_values`` of the settings,
with a comment on each value), the templates (the same documents `calmq k8s render` renders,
as Go templates, calmq/tooling/manifests.py), the helpers, and ``files/`` (the Grafana
dashboard). `calmq k8s chart` runs it; tests/unit/test_chart.py fails when the committed
chart differs from a fresh one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from calmq import __version__
from calmq.tooling import keda
from calmq.tooling.kubernetes import DOCS, SECRETS_HELPER, chart_files
from calmq.tooling.manifests import HELPERS, helm_template

__all__ = ["chart", "values_text", "write_chart"]

HEADER = "Written by `calmq k8s chart` from calmq/tooling/kubernetes.py; edit that, not this."

# A comment above a value of values.yaml, by its dotted path.
COMMENTS: dict[str, str] = {
    "image": "The calmq image every container runs: repository:tag, or repository@digest "
             "when digest is set.",
    "imagePullSecrets": "Secrets to pull the image with: [{name: regcred}].",
    "namespace": "create: render the Namespace (with its PodSecurity labels). With Helm, "
                 "create it yourself (kubectl create namespace, then the labels in "
                 "docs/how-to/deploy-kubernetes.md) or set create and install without "
                 "--create-namespace.",
    "commonLabels": "Labels added to every object and pod.",
    "strictSettings": "true: a pod stops on a CALMQ_ setting it does not know; false (the "
                      "default here): it logs a warning, so a ConfigMap one release ahead "
                      "or behind the image does not crash-loop an upgrade or a rollback.",
    "config": "calmq settings (docs/reference/settings.md) by name, without CALMQ_: the "
              "ConfigMap holds these and nothing else, so an upgrade's new defaults arrive. "
              "provider_url is required.",
    "secretsVersion": "Change it (to the date, a version) when you rotate a Secret's value: "
                      "the pods then roll with the new one.",
    "secretSettings": "Settings read from Secrets (secretKeyRef), by setting name: "
                      "secretName and key of each (a database operator's Secret as it "
                      "is: CloudNativePG <cluster>-app key uri, Strimzi's KafkaUser Secret "
                      "key password, say); parts: only those parts get it (api, relay, "
                      "forwarder, reaper, worker, batcher, migrate, kafka-setup); an empty "
                      "secretName leaves the setting unset (migrate_database_url and "
                      "relay_database_url then fall back to database_url). Any other "
                      "setting can be added the same way. KEDA's TriggerAuthentication "
                      "reads the Kafka ones from the same Secret keys.",
    "secretFiles": "Settings that name a file (CAs, client certificates and keys): the file "
                   "is the key of a Secret, mounted read-only at "
                   "/etc/calmq/secrets/<setting, dashed>/<key>, and the setting is that "
                   "path. secretName empty: not mounted (a path in config, or none). The "
                   "Kafka CA, certificate and key also reach KEDA's TriggerAuthentication "
                   "(Strimzi: <cluster>-cluster-ca-cert key ca.crt, the KafkaUser's "
                   "Secret keys user.crt and user.key).",
    "extraEnv": "Environment every container gets (AWS_REGION, say); each part has its own "
                "extraEnv too.",
    "serviceAccount": "The ServiceAccount of the long-running parts; its annotations carry "
                      "the cloud role for the bucket (IRSA: eks.amazonaws.com/role-arn, "
                      "Workload Identity: iam.gke.io/gcp-service-account). Each part's "
                      "serviceAccountName overrides it.",
    "scrapeAnnotations": "prometheus.io/scrape, port and path on every pod (the scrape "
                         "config of docs/how-to/alerting.md reads them).",
    "api": "The intake API. metricsPort: /metrics on its own port (not the API's); "
           "console.enabled false turns the web console off, console.port gives it a port "
           "of its own (0: the API's).",
    "api.preStopSeconds": "Pause before SIGTERM while the Service stops routing to the pod.",
    "relay": "The outbox relay: always one replica (it owns the replication slot).",
    "jobs": "The migrate and Kafka setup Jobs: pre-install/pre-upgrade hooks (Helm) and "
            "PreSync hooks (Argo CD). serviceAccountName empty: the namespace's default "
            "account (a hook runs before the release's own exists).",
    "workers": "Worker pools. poolDefaults holds every value of a pool; each entry of pools "
               "names only what differs (a key it sets wins whole, even false). A pool's "
               "graceSeconds covers its longest step timeout, terminationGracePeriodSeconds "
               "that plus 15 s of drain.",
    "workers.poolDefaults.keda": "KEDA ScaledObject. lagThreshold: the worker's in-flight "
                                 "window (concurrency + concurrency // 8); maxReplicaCount: "
                                 "min(partitions of the pool's topics, replicas the token "
                                 "budget keeps busy), computed by `calmq k8s values` from "
                                 "the settings; minReplicaCount 1 for a pool that takes "
                                 "interactive work. enabled false: replicas instead. With "
                                 "Kafka security in config, each pool gets a "
                                 "TriggerAuthentication with the pods' credentials, unless "
                                 "authenticationRef names one of your own (which then "
                                 "carries sasl and tls too).",
    "workers.poolDefaults.batcher": "The pool's batch lane (calmq batcher).",
    "monitoring": "Prometheus Operator and Grafana, each off until enabled: a PodMonitor "
                  "per part, the PrometheusRule (runbookBaseUrl: where your copy of the "
                  "docs is served, the rules' runbook_url are paths under it), and the "
                  "dashboard ConfigMap for Grafana's sidecar.",
    "networkPolicy": "Ingress rules: the API port from apiFrom, metrics from metricsFrom, "
                     "the console's own port from consoleFrom (NetworkPolicyPeer lists; "
                     "empty: from anywhere). Other traffic to calmq's pods is refused.",
}


def values_text(values: Mapping[str, Any], header: str) -> str:
    """``values`` as YAML, with the comments above the values they explain."""
    import yaml

    body = yaml.safe_dump(dict(values), sort_keys=False, width=100)
    out = [f"# {line}".rstrip() for line in header.splitlines()]
    stack: list[tuple[int, str]] = []
    for line in body.splitlines():
        match = re.match(r"^( *)([A-Za-z0-9_.\-/]+):", line)
        if match:
            indent = len(match.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match.group(2)))
            note = COMMENTS.get(".".join(key for _, key in stack))
            if note:
                out += _wrap(note, indent)
        out.append(line)
    return "\n".join(out) + "\n"


def _wrap(text: str, indent: int) -> list[str]:
    import textwrap

    return [" " * indent + "# " + line
            for line in textwrap.wrap(text, width=96 - indent)]


def chart(values: Mapping[str, Any]) -> dict[str, str]:
    """``{path in the chart: text}``."""
    import yaml

    from calmq.tooling.values_schema import schema_text

    meta = {
        "apiVersion": "v2",
        "name": "calmq",
        "description": "calmq: slow AI steps out of the request, on Kafka and PostgreSQL",
        "type": "application",
        "version": __version__,
        "appVersion": __version__,
        # The preStop sleep action (GA in 1.30) and PodSecurity admission.
        "kubeVersion": ">=1.30.0-0",
    }
    files: dict[str, str] = {
        "Chart.yaml": f"# {HEADER}\n" + yaml.safe_dump(meta, sort_keys=False),
        "values.yaml": values_text(values, HEADER + "\nEvery value the templates read, with "
                                   "the defaults calmq computes for its default settings."),
        # Helm checks every install, upgrade and template against it: a typo fails.
        "values.schema.json": schema_text(values),
        ".helmignore": "# " + HEADER + "\n*.orig\n*.swp\n",
        "templates/_helpers.tpl": "{{- /* " + HEADER + " */}}\n" + HELPERS + "\n"
                                  + keda.HELPER + SECRETS_HELPER,
        "templates/NOTES.txt": (
            "calmq {{ .Chart.AppVersion }} in {{ .Release.Namespace }}.\n"
            "The migrate and Kafka setup Jobs ran as hooks before the parts started.\n"
            "Next: create a tenant and send a job (docs/how-to/deploy-kubernetes.md, "
            "\"Check that jobs flow\").\n"),
    }
    by_template: dict[str, list[Any]] = {}
    for doc in DOCS:
        by_template.setdefault(doc.template, []).append(doc)
    for name, docs in by_template.items():
        files[f"templates/{name}"] = helm_template(docs, HEADER)
    for name, text in chart_files().items():
        files[f"files/{name}"] = text
    return files


def write_chart(values: Mapping[str, Any], folder: Path) -> list[Path]:
    """Write the chart into ``folder``, removing templates that are no longer made."""
    written = []
    made = chart(values)
    templates = folder / "templates"
    if templates.is_dir():
        for old in templates.iterdir():
            if f"templates/{old.name}" not in made:
                old.unlink()
    for name, text in made.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
