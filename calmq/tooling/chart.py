"""The Helm chart deploy/helm/calmq, written from the one renderer (calmq/tooling/kubernetes.py).

``write_chart`` writes ``Chart.yaml``, ``values.yaml`` (``default_values`` of the settings,
with a comment on each value), the templates (the same documents `calmq k8s render` renders,
as Go templates, calmq/tooling/manifests.py), the helpers, and ``files/`` (the Grafana
dashboard). `calmq k8s chart` runs it; tests/unit/test_chart.py fails when the committed
chart differs from a fresh one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from calmq import __version__
from calmq.tooling import keda
from calmq.tooling.kubernetes import DOCS, SECRETS_HELPER, chart_files
from calmq.tooling.manifests import HELPERS, helm_template

__all__ = ["CHART_VERSION", "chart", "values_text", "write_chart"]

# The chart's own version: raise it with every change to a template or a value, apart
# from calmq's (appVersion), so a chart fix ships without a calmq release and the other way.
CHART_VERSION = "0.1.0"

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
    "nameOverride": "The name label and the name part of every object's name (default "
                    "calmq).",
    "fullnameOverride": "Every object's name prefix. Empty: the release's name when it holds "
                        "calmq, else RELEASE-calmq; two releases in one namespace never "
                        "share a name.",
    "commonLabels": "Labels added to every object and pod.",
    "apiVersions": "APIs to take as served where Helm cannot ask the cluster (helm lint): "
                   "keda.sh/v1alpha1, monitoring.coreos.com/v1, gateway.networking.k8s.io/v1. "
                   "A ScaledObject, PodMonitor, PrometheusRule or HTTPRoute asked for on a "
                   "cluster that serves none fails the install, saying so.",
    "openshift": "true: no runAsUser, runAsGroup or fsGroup in any pod or container; "
                 "OpenShift's restricted SCC assigns them from the namespace's range.",
    "podSecurityContext": "Every pod's securityContext (the image's uid 10001; PodSecurity "
                          "restricted).",
    "containerSecurityContext": "Every container's securityContext.",
    "topologySpread": "A soft spread (ScheduleAnyway) of each Deployment's replicas over "
                      "topologyKey; a part's topologySpreadConstraints are added to it.",
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
    "api.pdb": "The API's PodDisruptionBudget, rendered only above one replica (at one it "
               "would block every node drain).",
    "api.ingress": "An Ingress to the API. bodySize: the largest upload and its form "
                   "(max_upload_bytes); timeoutSeconds: how long SSE streams and Prefer: wait "
                   "stay open; nginx: write both as ingress-nginx annotations (other "
                   "controllers: set annotations).",
    "api.httpRoute": "A Gateway API HTTPRoute to the API (parentRefs: your Gateway); "
                     "timeoutSeconds becomes its request timeouts. A Gateway's body-size "
                     "limit is its implementation's policy: allow ingress.bodySize there.",
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
    "workers.poolDefaults.pdb": "Opt-in PodDisruptionBudget per pool (maxUnavailable).",
    "monitoring": "Prometheus Operator and Grafana, each off until enabled: a PodMonitor "
                  "per part, the PrometheusRule (runbookBaseUrl: where your copy of the "
                  "docs is served, the rules' runbook_url are paths under it), and the "
                  "dashboard ConfigMap for Grafana's sidecar.",
    "jobs.migrate": "hook false: a plain Job instead of a Helm/Argo CD hook (Flux, "
                    "Terraform); it must then finish before the parts that need the schema "
                    "start, and be deleted before an upgrade changes it.",
    "jobs.kafkaSetup": "hook false: as jobs.migrate.",
    "tests": "enabled: the `helm test` pod, which runs `calmq health` against the release.",
    "extraObjects": "Objects of your own, each rendered as it is (a Secret, an "
                    "ExternalSecret, a ServiceMonitor).",
        "networkPolicy": "Ingress rules: the API port from apiFrom, metrics from metricsFrom, "
                     "the console's own port from consoleFrom (NetworkPolicyPeer lists; "
                     "empty: from anywhere). Other traffic to calmq's pods is refused.",
}


NOTES = """\
calmq {{ .Chart.AppVersion }} is installed as {{ include "calmq.fullname" . }} in \
{{ .Release.Namespace }}.
{{- if or .Values.jobs.migrate.hook .Values.jobs.kafkaSetup.hook }}
The migrate and Kafka setup Jobs ran as hooks before the parts started.
{{- end }}

Next:
  kubectl -n {{ .Release.Namespace }} rollout status \
deployment/{{ include "calmq.fullname" . }}-api
  helm test {{ .Release.Name }} -n {{ .Release.Namespace }}    # calmq health, in the cluster
  kubectl -n {{ .Release.Namespace }} exec deploy/{{ include "calmq.fullname" . }}-api -- \
calmq tenants create my-team -o json
  kubectl -n {{ .Release.Namespace }} port-forward \
svc/{{ include "calmq.fullname" . }}-api 8080:{{ .Values.api.service.port }}

Then send a job (docs/how-to/deploy-kubernetes.md, "Check that jobs flow"). Before an
upgrade, read UPGRADING.md for the release you move to.
"""


def readme(values: Mapping[str, Any]) -> str:
    """The chart's README: how to install it, and every value the schema describes."""
    from calmq.tooling.values_schema import values_schema

    rows: list[str] = []

    def walk(schema: Mapping[str, Any], path: str, default: Any) -> None:
        props = schema.get("properties") if path != "config" else None
        note = schema.get("description", "")
        if note or not props:
            kind = schema.get("type", "")
            kind = " or ".join(kind) if isinstance(kind, list) else kind
            shown = "" if props else f"`{json.dumps(default)}`"
            if path == "config":
                shown = "(the settings that were set)"
            text = note.replace("|", "\\|")
            rows.append(f"| `{path}` | {kind} | {shown} | {text} |")
        for key, sub in (props or {}).items():
            if path.endswith("pools") or path in ("secretSettings", "secretFiles"):
                continue
            walk(sub, f"{path}.{key}" if path else key,
                 default.get(key) if isinstance(default, Mapping) else None)

    for key, sub in values_schema(values)["properties"].items():
        walk(sub, key, values.get(key))
    return "\n".join([
        "<!-- " + HEADER + " -->",
        "# calmq chart",
        "",
        "calmq runs slow AI steps (LLM calls, embeddings, transcription) outside the HTTP "
        "request, on Kafka and PostgreSQL. This chart installs every part: the API, the "
        "outbox relay, the retry forwarder, the reaper, a worker Deployment (with its KEDA "
        "ScaledObject) and a batcher per pool, the migrate and Kafka setup Jobs as hooks, and "
        "optionally an Ingress or HTTPRoute, PodMonitors, the PrometheusRule, the Grafana "
        "dashboard and NetworkPolicies.",
        "",
        "```sh",
        "helm install calmq oci://ghcr.io/calmq/charts/calmq --version " + CHART_VERSION + " \\",
        "  --namespace calmq --create-namespace -f my-values.yaml",
        "helm test calmq -n calmq",
        "```",
        "",
        "`config.provider_url` is required; the database URL and the provider's key come "
        "from the Secret `calmq` (`secretSettings`). docs/how-to/deploy-kubernetes.md walks "
        "through an install; UPGRADING.md says what each release changes for an operator.",
        "`values.schema.json` refuses a value the chart does not know, naming it.",
        "",
        "Every part (`api`, `relay`, `forwarder`, `reaper`, `jobs`, each pool and its "
        "`batcher`) also takes `resources`, `nodeSelector`, `tolerations`, `affinity`, "
        "`topologySpreadConstraints`, `priorityClassName`, `serviceAccountName`, `labels`, "
        "`annotations`, `podLabels`, `podAnnotations`, `extraEnv`, `extraVolumes`, "
        "`extraVolumeMounts`, `initContainers` and `sidecars`.",
        "",
        "## Values",
        "",
        "| Value | Type | Default | Description |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
    ])


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
        "version": CHART_VERSION,
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
        "templates/NOTES.txt": NOTES,
        "README.md": readme(values),
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
        for old in templates.rglob("*"):
            if old.is_file() and f"templates/{old.relative_to(templates)}" not in made:
                old.unlink()
    for name, text in made.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
