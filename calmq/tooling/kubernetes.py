"""Kubernetes manifests for every part of calmq: the one renderer behind `calmq k8s render`,
the Kustomize base in deploy/kubernetes/ and the Helm chart in deploy/helm/calmq.

Two steps, each in one place:

1. **Values** (``default_values``): the chart's values, computed from the settings and the
   registered workflows — the pools, each pool's grace period (its longest step), KEDA's
   lag threshold (the worker's in-flight window) and replica cap (partitions and the token
   budget), the resources measured per part, and ``config``: the settings that were set,
   which the ConfigMap holds (only those: an upgrade's new defaults then arrive).
   ``deploy/helm/calmq/values.yaml`` is this for the default settings.
2. **Manifests** (``DOCS``): every object, described once (calmq/tooling/manifests.py)
   and read two ways: rendered here from the values, and written out as the chart's
   templates (calmq/tooling/chart.py). ``helm template`` and `calmq k8s render` with the
   same values give the same objects (tests/unit/test_chart.py).

What is rendered (docs/how-to/deploy-kubernetes.md says how to apply it): the ConfigMap
``calmq`` (every container takes it with ``envFrom``, so no part can miss a setting the
others have), the settings read from Secrets (``secretSettings``: ``secretKeyRef`` by
setting, so a database operator's Secret is used as it is; ``secretFiles``: a CA, a client
certificate or key, or any secret kept out of the environment, mounted from a Secret's
key), the migration and Kafka setup Jobs as pre-install/pre-upgrade hooks (Helm and Argo
CD; they carry their settings inline, so they run before anything else exists), the API
(Deployment, Service, PDB), the relay (one replica, ``Recreate``), the retry forwarder, the
reaper, per pool the workers with their KEDA ScaledObject (and, for a Kafka that wants TLS
or SASL, its TriggerAuthentication from the same Secret keys: calmq/tooling/keda.py) and
the batcher, and, each behind a value, PodMonitors, the
PrometheusRule, the Grafana dashboard, NetworkPolicies, the Namespace (PodSecurity
``restricted``) and the ServiceAccount.

Every pod sets ``enableServiceLinks: false``: a Service named ``calmq-*`` would otherwise
inject ``CALMQ_*_PORT=tcp://...`` variables that look like settings.

The pieces are in calmq/tooling/k8s/, a module per thing rendered: ``values`` (step 1),
``secrets`` (the secret settings and files), ``objects`` (what every object is built of),
``jobs``, ``api``, ``workers``, ``monitoring`` and ``cluster`` (step 2's objects). This
module puts the documents together and renders, writes and dumps them.
"""


from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from calmq.errors import ConfigError
from calmq.settings import Settings
from calmq.tooling.k8s.api import _api
from calmq.tooling.k8s.cluster import _base, _extra_objects, _network_policies, _tests
from calmq.tooling.k8s.jobs import _jobs
from calmq.tooling.k8s.monitoring import _monitoring, monitoring_file
from calmq.tooling.k8s.secrets import (
    _FILE_SETTING,
    CONFIG_NAME,
    SECRET_FILES,
    SECRET_PLACEHOLDERS,
    SECRET_SETTINGS,
    SECRETS_HELPER,
    NoSecrets,
    config_secrets,
)
from calmq.tooling.k8s.values import (
    DRAIN_SECONDS,
    METRICS_PORT,
    default_values,
    load_settings,
    load_values,
    longest_step,
)
from calmq.tooling.k8s.workers import _singletons, _workers
from calmq.tooling.manifests import Context, Doc, documents, merge_values

__all__ = [
    "CONFIG_NAME",
    "DOCS",
    "DRAIN_SECONDS",
    "METRICS_PORT",
    "SECRETS_HELPER",
    "SECRET_FILES",
    "SECRET_SETTINGS",
    "chart_files",
    "config_secrets",
    "default_values",
    "dump",
    "dump_all",
    "kustomization",
    "load_settings",
    "load_values",
    "longest_step",
    "monitoring_file",
    "render",
    "secret_template",
    "values_for",
    "write",
]

def _docs() -> list[Doc]:
    return [*_base(), *_jobs(), *_api(), *_singletons(), *_workers(), *_monitoring(),
            *_network_policies(), *_tests(), *_extra_objects()]



def chart_files() -> dict[str, str]:
    """The chart's ``files/``: what the templates read with ``.Files.Get``."""
    return {"calmq-dashboard.json": monitoring_file("calmq-dashboard.json")}


class _LazyDocs(Sequence[Doc]):
    """The documents, built on first use (reading the alert rules is file work)."""

    _docs: list[Doc] | None = None

    def _all(self) -> list[Doc]:
        if self._docs is None:
            self._docs = _docs()
        return self._docs

    def __getitem__(self, index: Any) -> Any:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())


DOCS: Sequence[Doc] = _LazyDocs()
_WORKER_FILES = ("60-worker-",)


def render(values: Mapping[str, Any], namespace: str = "calmq", *, only: str | None = None
           ) -> dict[str, dict[str, Any]]:
    """``{file name: manifest}`` of the values; the numbers in the names are the order to
    apply them in (``jobs/`` first: they are hooks). ``only="workers"``: the worker
    Deployments and their ScaledObjects alone."""
    from calmq.tooling.values_schema import check_values

    ctx = Context(values, namespace, chart_files())
    # Before any document: the hook Jobs carry the config inline, and --only workers
    # renders no ConfigMap, so its check alone would not see every path.
    NoSecrets().evaluate(ctx)
    # As helm checks values.schema.json: a misspelt value fails, naming its path.
    check_values(values)
    if only is None:
        return dict(documents(DOCS, ctx))
    if only != "workers":
        raise ConfigError(f"--only {only}: the one subset is workers", code="invalid_values")
    docs = [d for d in DOCS if d.template == "workers.yaml"]
    return {k: v for k, v in documents(docs, ctx) if k.startswith(_WORKER_FILES)}


def values_for(settings: Settings, *files: Path) -> dict[str, Any]:
    """The settings' default values, with each values file merged over them in order."""
    return merge_values(default_values(settings), *(load_values(f) for f in files))


def secret_template(values: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    """The Secret ``calmq``'s shape with placeholders: the keys the ``secretSettings`` read
    from it and the files the ``secretFiles`` mount from it. Create the real one with
    kubectl, or your secret manager (docs)."""
    def keys(group: str) -> set[str]:
        return {str(ref["key"]) for ref in (values.get(group) or {}).values()
                if ref and ref.get("secretName") == CONFIG_NAME and ref.get("key")}

    data = {k: SECRET_PLACEHOLDERS.get(k, "CHANGE-ME") for k in keys("secretSettings")}
    for name, ref in (values.get("secretFiles") or {}).items():
        if ref and ref.get("secretName") == CONFIG_NAME and ref.get("key"):
            data[str(ref["key"])] = ("CHANGE-ME (PEM)" if name.endswith(_FILE_SETTING)
                                     else "CHANGE-ME")
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": CONFIG_NAME, "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": "calmq",
                                    "app.kubernetes.io/component": "config"}},
            "stringData": dict(sorted(data.items()))}


def kustomization(manifests: Mapping[str, dict[str, Any]], values: Mapping[str, Any],
                  namespace: str) -> dict[str, dict[str, Any]]:
    """The Kustomize base: ``kustomization.yaml`` for the folder (the ConfigMap generated,
    so its name carries a hash of its data and a change rolls the pods; the image under
    ``images:``; the namespace) and ``jobs/kustomization.yaml`` for the hook Jobs."""
    config = manifests["10-configmap.yaml"]
    image = values["image"]
    entry: dict[str, Any] = {"name": str(image["repository"]),
                             "newName": str(image["repository"])}
    if image.get("digest"):
        entry["digest"] = str(image["digest"])
    else:
        entry["newTag"] = str(image["tag"])
    top = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": namespace,
        "resources": [f for f in manifests if "/" not in f and f != "10-configmap.yaml"]
        + ["jobs"],
        "configMapGenerator": [{
            "name": CONFIG_NAME,
            "options": {"labels": dict(config["metadata"]["labels"])},
            "literals": [f"{k}={v}" for k, v in config["data"].items()],
        }],
        "images": [entry],
    }
    jobs = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": sorted(f.removeprefix("jobs/") for f in manifests
                                if f.startswith("jobs/"))}
    return {"kustomization.yaml": top, "jobs/kustomization.yaml": jobs}


def dump(manifest: Any, command: str) -> str:
    """YAML with the header naming the command, and no anchors: the labels a Deployment
    repeats in its selector and template are written out, as a reader expects them."""
    import yaml

    class _Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    header = f"# Rendered by `{command}`; edit the values, not this file.\n"
    return header + yaml.dump(manifest, Dumper=_Plain, sort_keys=False, width=100)


def dump_all(manifests: Mapping[str, dict[str, Any]], command: str) -> str:
    """Every manifest as one multi-document YAML stream (what `-o -` prints)."""
    return "".join(("---\n" if i else "") + dump(m, command)
                   for i, m in enumerate(manifests.values()))


def _prune(folder: Path, keep: set[str], command: str) -> None:
    """Remove files an earlier render of the same command wrote that this one does not (a
    pool that is gone, a file that moved), never a file of anyone else."""
    if not folder.is_dir():
        return
    mark = f"# Rendered by `{command}`"
    for path in sorted(folder.rglob("*.yaml")):
        name = str(path.relative_to(folder))
        if name not in keep and path.read_text(encoding="utf-8").startswith(mark):
            path.unlink()


def write(values: Mapping[str, Any], folder: Path, namespace: str = "calmq", *,
          only: str | None = None, command: str = "calmq k8s render") -> list[Path]:
    """Render into ``folder``: the manifests, the hook Jobs in ``jobs/`` (where `kubectl
    apply -f folder` does not re-apply them), the Kustomize base, and the Secret's template
    in ``secret-template/`` (never applied with the folder)."""
    manifests = render(values, namespace, only=only)
    files: dict[str, Any] = dict(manifests)
    if only is None:
        files.update(kustomization(manifests, values, namespace))
        files["secret-template/calmq-secret.yaml"] = secret_template(values, namespace)
    _prune(folder, set(files), command)
    written = []
    for name, manifest in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump(manifest, command), encoding="utf-8")
        written.append(path)
    return written
