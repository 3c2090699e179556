"""What every object is built of: a part's values (``_Part``), names, labels and metadata,
the calmq container with its settings from the ConfigMap and the Secrets, the pod and the
Deployment."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from calmq.tooling.k8s.secrets import _FILE_SETTING, SECRET_FILES_ROOT
from calmq.tooling.k8s.values import METRICS_PORT
from calmq.tooling.manifests import (
    And,
    Checksum,
    Context,
    Dashed,
    Default,
    Each,
    Expr,
    FullName,
    Has,
    Image,
    Key,
    Namespace,
    Not,
    Or,
    Printf,
    Release,
    Spread,
    Text,
    Upper,
    Val,
    When,
    Without,
)

PARTS = ("api", "relay", "forwarder", "reaper", "worker", "batcher", "migrate",
         "kafka-setup")


@dataclass(frozen=True)
class _Part:
    """Where a part's values are: under ``root`` of the values, or of the pool entry."""

    name: str  # the component: api, relay, worker, ...
    root: tuple[str, ...]
    scope: str = "root"

    def __call__(self, *path: str, block: bool = False) -> Val:
        return Val((*self.root, *path), self.scope, block)


def _root(*path: str, block: bool = False) -> Val:
    return Val(path, block=block)


@dataclass(frozen=True)
class AppVersion(Expr):
    """calmq's version, the chart's appVersion (the recommended version label)."""

    def evaluate(self, ctx: Context) -> Any:
        from calmq import __version__

        return __version__

    def go(self) -> str:
        return "$.Chart.AppVersion"


# The name label: the chart's name, or nameOverride.
_NAME = Default(Val(("nameOverride",)), "calmq")


def _named(suffix: str, *args: Any) -> Printf:
    """An object's name: the release's prefix (``FullName``), then ``suffix``."""
    return Printf("%s-" + suffix, FullName(), *args)


def _selector(component: str, pool: Any = None) -> dict[str, Any]:
    """The labels a part's pods are selected by: the release's (instance) among them, so
    two releases in one namespace never select each other's pods."""
    labels: dict[str, Any] = {"app.kubernetes.io/name": _NAME,
                              "app.kubernetes.io/instance": Release(),
                              "app.kubernetes.io/component": component}
    if pool is not None:
        labels["calmq.dev/pool"] = pool
    return labels


def _labels(component: str, pool: Any = None) -> dict[Any, Any]:
    """An object's labels: the selector's, the part-of and the scrape job name that both
    Prometheus discovery styles read (the PodMonitor's jobLabel; the pod relabelling of
    docs/how-to/alerting.md)."""
    labels: dict[Any, Any] = {**_selector(component, pool), "app.kubernetes.io/part-of": "calmq",
                              "app.kubernetes.io/version": AppVersion()}
    if component in PARTS:
        labels["calmq.dev/job"] = f"calmq-{component}"
    labels[Spread(_root("commonLabels"))] = None
    return labels


def _meta(name: Any, component: str, part: _Part | None = None, *, pool: Any = None,
          annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    labels = _labels(component, pool)
    meta: dict[str, Any] = {"name": name, "namespace": Namespace(), "labels": labels}
    if part is not None:
        labels[Spread(part("labels"))] = None
        if annotations:
            meta["annotations"] = {**annotations, Spread(part("annotations")): None}
        else:
            meta["annotations"] = When(part("annotations"), part("annotations", block=True))
    elif annotations:
        meta["annotations"] = annotations
    return meta


def _when_set(value: Val, *, block: bool = False) -> When:
    return When(value, Val(value.path, value.scope, block))


def _for_part(scope: str, part: str) -> And:
    """An entry of ``secretSettings`` or ``secretFiles`` (bound to ``scope``) this part
    gets: it names a Secret, and names this part among its ``parts`` (or none: all)."""
    def ref(*path: str) -> Val:
        return Val(path, scope)

    return And((ref("secretName"), Or((Not(ref("parts")), Has(ref("parts"), part)))))


def _secret_env(part: str) -> Each:
    """The settings read from Secrets: every ``secretSettings`` entry with a Secret that
    names this part (or no part: all of them)."""
    def ref(*path: str) -> Val:
        return Val(path, "secret")

    return Each(
        _root("secretSettings"), "secret",
        {"name": Printf("CALMQ_%s", Upper(Key("secret"))),
         "valueFrom": {"secretKeyRef": {"name": ref("secretName"), "key": ref("key")}}},
        where=_for_part("secret", part))


def _file_dir() -> Printf:
    return Printf(f"{SECRET_FILES_ROOT}/%s", Dashed(Key("file")))


@dataclass(frozen=True)
class _FileVariable(Expr):
    """The variable a ``secretFiles`` entry sets to its file's path: ``CALMQ_<NAME>`` for a
    setting that names a file (``*_location``), ``CALMQ_<NAME>_FILE`` for any other (calmq
    reads the setting from the file, so its value never enters the environment)."""

    of: Key

    def evaluate(self, ctx: Context) -> Any:
        name = str(self.of.evaluate(ctx))
        return f"CALMQ_{name.upper()}" + ("" if name.endswith(_FILE_SETTING) else "_FILE")

    def go(self) -> str:
        of = self.of.go()
        return (f'(printf "CALMQ_%s%s" (upper {of}) '
                f'(ternary "" "_FILE" (hasSuffix "{_FILE_SETTING}" {of})))')




def _file_env(part: str) -> Each:
    """The settings whose file is a Secret's key (``secretFiles``): the file's path where
    the part mounts it (``_file_mount``), as the setting or as its ``_FILE`` variable."""
    return Each(
        _root("secretFiles"), "file",
        {"name": _FileVariable(Key("file")),
         "value": Printf("%s/%s", _file_dir(), Val(("key",), "file"))},
        where=_for_part("file", part))


def _file_mount(part: str) -> Each:
    return Each(_root("secretFiles"), "file",
                {"name": Dashed(Key("file")), "mountPath": _file_dir(), "readOnly": True},
                where=_for_part("file", part))


def _file_volume(part: str) -> Each:
    """The Secret volume of a ``secretFiles`` entry: its one key, readable by the pod's
    group (fsGroup, the image's user) and no one else."""
    key = Val(("key",), "file")
    return Each(_root("secretFiles"), "file",
                {"name": Dashed(Key("file")),
                 "secret": {"secretName": Val(("secretName",), "file"),
                            "items": [{"key": key, "path": key}],
                            "defaultMode": 0o440}},
                where=_for_part("file", part))


def _config_env() -> Each:
    """The ConfigMap's entries as the container's own env (the Jobs: they run as hooks,
    before the ConfigMap exists)."""
    return Each(_root("config"), "cfg",
                {"name": Printf("CALMQ_%s", Upper(Key("cfg"))), "value": Text(Val((), "cfg"))})


def _probe(path: str, port: str, *, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": 2, "failureThreshold": failures}


def _container(name: Any, args: list[Any], part: _Part, *,
               env: Sequence[Any] = (), ports: Sequence[Any] = (),
               probes: tuple[str, str, str] | None = None, inline_config: bool = False,
               lifecycle: dict[str, Any] | None = None) -> dict[str, Any]:
    """One calmq container: ``calmq <args>``, every setting from the ConfigMap (Jobs: the
    same entries inline) and the Secrets. ``probes``: (port, liveness path, readiness
    path); the parts without an HTTP API are probed on their metrics port: /livez fails
    once the part's event loop stops turning (calmq/heartbeat.py), /metrics answers while
    the process runs."""
    container: dict[str, Any] = {
        "name": name,
        "image": Image(),
        "imagePullPolicy": _root("image", "pullPolicy"),
        "command": ["calmq"],
        "args": args,
    }
    if not inline_config:
        container["envFrom"] = [{"configMapRef": {"name": FullName()}}]
    # env wins over envFrom: a Deployment's own settings (its pool) over the shared ones.
    container["env"] = [
        # The ConfigMap may name a setting this image does not know (an upgrade's or a
        # rollback's skew): a warning in the log, not a crash loop.
        {"name": "CALMQ_STRICT_SETTINGS", "value": Text(_root("strictSettings"))},
        *([_config_env()] if inline_config else []),
        *env,
        _secret_env(part.name),
        _file_env(part.name),
        Spread(_root("extraEnv")),
        Spread(part("extraEnv")),
    ]
    if ports:
        container["ports"] = list(ports)
    if probes is not None:
        port, live, ready = probes
        container["startupProbe"] = _probe(ready, port, period=2, failures=30)
        container["livenessProbe"] = _probe(live, port, period=10, failures=3)
        container["readinessProbe"] = _probe(ready, port, period=5, failures=2)
    if lifecycle is not None:
        container["lifecycle"] = lifecycle
    container["resources"] = part("resources", block=True)
    # openshift: the restricted SCC assigns the UID and GID; a fixed one is refused.
    container["securityContext"] = Without(_root("containerSecurityContext"), _IDS,
                                           _root("openshift"))
    container["volumeMounts"] = [{"name": "tmp", "mountPath": "/tmp"},  # noqa: S108
                                 _file_mount(part.name), Spread(part("extraVolumeMounts"))]
    return container


def _spread(selector: dict[str, Any] | None, part: _Part) -> Any:
    """Soft topology spread (``topologySpread``: ScheduleAnyway, so a small cluster still
    schedules every replica) over the part's own pods, and the part's own constraints."""
    own = part("topologySpreadConstraints")
    if selector is None:
        return _when_set(own, block=True)
    spread = ("topologySpread",)
    on = _root(*spread, "enabled")
    soft = {"maxSkew": _root(*spread, "maxSkew"), "topologyKey": _root(*spread, "topologyKey"),
            "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": selector}}
    return When(Or((on, own)), [When(on, soft), Spread(own)])


def _pod(part: _Part, containers: list[Any], *, grace: Any, restart: str = "Always",
         service_account: Any = None, component: str | None = None) -> dict[str, Any]:
    account = service_account if service_account is not None else Default(
        part("serviceAccountName"),
        And((_root("serviceAccount", "create"),
             Default(_root("serviceAccount", "name"), FullName()))))
    return {
        # Service links would inject CALMQ_<SERVICE>_PORT=tcp://... for a Service named
        # calmq-*; calmq tolerates them, but they are noise and shadow real settings.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # calmq never calls the Kubernetes API
        "serviceAccountName": When(account, account),
        "restartPolicy": restart,
        "terminationGracePeriodSeconds": grace,
        # The image's user (Dockerfile: uid 10001); the root filesystem is read-only and
        # the only writable place is /tmp. PodSecurity "restricted" admits this pod.
        # openshift: without runAsUser, runAsGroup and fsGroup, which the SCC assigns.
        "securityContext": Without(_root("podSecurityContext"), _IDS, _root("openshift")),
        "imagePullSecrets": _when_set(_root("imagePullSecrets"), block=True),
        "priorityClassName": _when_set(part("priorityClassName")),
        "nodeSelector": _when_set(part("nodeSelector"), block=True),
        "tolerations": _when_set(part("tolerations"), block=True),
        "affinity": _when_set(part("affinity"), block=True),
        "topologySpreadConstraints": _spread(None, part),
        "initContainers": _when_set(part("initContainers"), block=True),
        "containers": [*containers, Spread(part("sidecars"))],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": part("tmpSizeLimit")}},
                    _file_volume(component or part.name), Spread(part("extraVolumes"))],
    }


_IDS = ("runAsUser", "runAsGroup", "fsGroup")


def _template_meta(part: _Part, component: str, pool: Any = None) -> dict[str, Any]:
    return {
        "labels": {**_labels(component, pool), Spread(part("podLabels")): None},
        "annotations": {
            # The ConfigMap's data and secretsVersion: a change rolls the pods.
            "checksum/config": Checksum(),
            "prometheus.io/scrape": When(_root("scrapeAnnotations"), "true"),
            "prometheus.io/port": When(_root("scrapeAnnotations"), str(METRICS_PORT)),
            "prometheus.io/path": When(_root("scrapeAnnotations"), "/metrics"),
            Spread(part("podAnnotations")): None,
        },
    }


def _deployment(name: Any, component: str, part: _Part, pod: dict[str, Any], *,
                replicas: Any, strategy: str = "RollingUpdate", pool: Any = None
                ) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if replicas is not None:
        spec["replicas"] = replicas
    # A Deployment's replicas spread over their own selector (a Job runs one pod).
    pod = {**pod, "topologySpreadConstraints": _spread(_selector(component, pool), part)}
    spec.update({
        "selector": {"matchLabels": _selector(component, pool)},
        "strategy": {"type": strategy},
        "template": {"metadata": _template_meta(part, component, pool), "spec": pod},
    })
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(name, component, part, pool=pool), "spec": spec}


def _metrics_part(component: str, part: _Part, args: list[Any], *, pool: Any = None,
                  env: Sequence[Any] = ()) -> dict[str, Any]:
    return _container(component, [*args, "--metrics-port", str(METRICS_PORT)], part, env=env,
                      ports=[{"name": "metrics", "containerPort": METRICS_PORT}],
                      probes=("metrics", "/livez", "/metrics"))



_POOL_DEFAULTS = ("workers", "poolDefaults")

