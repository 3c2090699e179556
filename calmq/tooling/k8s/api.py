"""The API: its Deployment, Service and PodDisruptionBudget, and the way in from outside
(an Ingress or a Gateway API HTTPRoute)."""

from __future__ import annotations

from calmq.tooling.k8s.objects import (
    _container,
    _deployment,
    _meta,
    _named,
    _Part,
    _pod,
    _root,
    _selector,
    _when_set,
)
from calmq.tooling.manifests import (
    Above,
    And,
    Check,
    Doc,
    Fail,
    Not,
    Printf,
    Served,
    Spread,
    Text,
    Val,
    When,
)

_API = _Part("api", ("api",))


def _api() -> list[Doc]:
    api = _API
    console_port = api("console", "port")
    container = _container(
        "api", ["api"], api,
        env=[{"name": "CALMQ_API_HOST", "value": "0.0.0.0"},
             {"name": "CALMQ_API_PORT", "value": Text(api("port"))},
             {"name": "CALMQ_API_METRICS_PORT", "value": Text(api("metricsPort"))},
             {"name": "CALMQ_API_CONSOLE", "value": Text(api("console", "enabled"))},
             When(console_port, {"name": "CALMQ_API_CONSOLE_PORT", "value": Text(console_port)})],
        ports=[{"name": "http", "containerPort": api("port")},
               {"name": "metrics", "containerPort": api("metricsPort")},
               When(console_port, {"name": "console", "containerPort": console_port})],
        probes=("http", "/healthz", "/readyz"),
        # Endpoints are removed from the Service while the pod still serves: a pause before
        # SIGTERM lets every proxy stop sending to it, so a rollout drops no request.
        lifecycle={"preStop": {"sleep": {"seconds": api("preStopSeconds")}}})
    pod = _pod(api, [container], grace=api("terminationGracePeriodSeconds"))
    deployment = _deployment(_named("api"), "api", api, pod, replicas=api("replicas"))
    deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = When(
        _root("scrapeAnnotations"), Text(api("metricsPort")))
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {**_meta(_named("api"), "api"),
                     "annotations": _when_set(api("service", "annotations"), block=True)},
        "spec": {"type": api("service", "type"), "selector": _selector("api"),
                 "ports": [{"name": "http", "port": api("service", "port"),
                            "targetPort": "http"},
                           When(console_port, {"name": "console", "port": console_port,
                                               "targetPort": "console"})]},
    }
    pdb = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(_named("api"), "api"),
        "spec": {"minAvailable": api("pdb", "minAvailable"),
                 "selector": {"matchLabels": _selector("api")}},
    }
    return [
        Doc(lambda _c: "30-api-deployment.yaml", "api.yaml", deployment),
        Doc(lambda _c: "30-api-service.yaml", "api.yaml", service),
        Doc(lambda _c: "30-api-pdb.yaml", "api.yaml", pdb,
            when=And((api("pdb", "enabled"), Above(api("replicas"), 1)))),
        *_routes(),
    ]


_GATEWAY_API = "gateway.networking.k8s.io/v1"


def _routes() -> list[Doc]:
    """The API from outside: an Ingress or a Gateway API HTTPRoute. Each carries what the
    API's requests need of a proxy: an upload's body size (ingress-nginx's annotation; a
    Gateway's own policy), and SSE streams and Prefer: wait held open for their time."""
    ingress, route = ("api", "ingress"), ("api", "httpRoute")
    seconds = Text(Val((*ingress, "timeoutSeconds")))
    nginx = Val((*ingress, "nginx"))
    annotations = {
        "nginx.ingress.kubernetes.io/proxy-body-size": When(nginx, Val((*ingress, "bodySize"))),
        "nginx.ingress.kubernetes.io/proxy-read-timeout": When(nginx, seconds),
        "nginx.ingress.kubernetes.io/proxy-send-timeout": When(nginx, seconds),
        # SSE: each event reaches the client when it is written, not when a buffer fills.
        "nginx.ingress.kubernetes.io/proxy-buffering": When(nginx, "off"),
        Spread(Val((*ingress, "annotations"))): None,
    }
    backend = {"service": {"name": _named("api"),
                           "port": {"number": _API("service", "port")}}}
    host = Val((*ingress, "host"))
    ing = {
        "apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
        "metadata": {**_meta(_named("api"), "api"), "annotations": annotations},
        "spec": {
            "ingressClassName": _when_set(Val((*ingress, "className"))),
            "tls": _when_set(Val((*ingress, "tls")), block=True),
            "rules": [{"host": When(host, host), "http": {"paths": [{
                "path": Val((*ingress, "path")), "pathType": "Prefix",
                "backend": backend}]}}],
        },
    }
    timeout = Printf("%ss", Text(Val((*route, "timeoutSeconds"))))
    http_route = {
        Check(Fail(Not(Served(_GATEWAY_API)),
                   f"api.httpRoute.enabled: this cluster serves no {_GATEWAY_API} (the "
                   "Gateway API's CRDs): install them, or use api.ingress")): None,
        "apiVersion": _GATEWAY_API, "kind": "HTTPRoute",
        "metadata": {**_meta(_named("api"), "api"),
                     "annotations": _when_set(Val((*route, "annotations")), block=True)},
        "spec": {
            "parentRefs": Val((*route, "parentRefs"), block=True),
            "hostnames": _when_set(Val((*route, "hostnames")), block=True),
            "rules": [{"backendRefs": [{"name": _named("api"),
                                        "port": _API("service", "port")}],
                       "timeouts": {"request": timeout, "backendRequest": timeout}}],
        },
    }
    return [Doc(lambda _c: "31-api-ingress.yaml", "ingress.yaml", ing,
                when=Val((*ingress, "enabled"))),
            Doc(lambda _c: "31-api-httproute.yaml", "ingress.yaml", http_route,
                when=Val((*route, "enabled")))]
