"""The long-running parts besides the API: the relay, the retry forwarder and the reaper,
and per pool the workers (with their KEDA ScaledObject) and the batcher."""

from __future__ import annotations

from typing import Any

from calmq.tooling import keda
from calmq.tooling.k8s.objects import (
    _POOL_DEFAULTS,
    _container,
    _deployment,
    _meta,
    _metrics_part,
    _named,
    _Part,
    _pod,
    _root,
    _selector,
)
from calmq.tooling.k8s.values import METRICS_PORT
from calmq.tooling.manifests import (
    And,
    Check,
    Dashed,
    Doc,
    Each,
    Fail,
    Key,
    Not,
    Served,
    Text,
    Val,
    When,
)


def _singletons() -> list[Doc]:
    relay, forwarder, reaper = (_Part(n, (n,)) for n in ("relay", "forwarder", "reaper"))
    return [
        # One relay: it owns the replication slot. Recreate stops the old pod before the new
        # one starts, so a rollout never has two relays waiting on the slot.
        Doc(lambda _c: "40-relay-deployment.yaml", "relay.yaml", _deployment(
            _named("relay"), "relay", relay,
            _pod(relay, [_metrics_part("relay", relay, ["relay"])],
                 grace=relay("terminationGracePeriodSeconds")),
            replicas=1, strategy="Recreate")),
        Doc(lambda _c: "50-forwarder-deployment.yaml", "forwarder.yaml", _deployment(
            _named("forwarder"), "forwarder", forwarder,
            _pod(forwarder, [_metrics_part("forwarder", forwarder, ["forwarder"])],
                 grace=forwarder("terminationGracePeriodSeconds")),
            replicas=forwarder("replicas"))),
        Doc(lambda _c: "50-reaper-deployment.yaml", "reaper.yaml", _deployment(
            _named("reaper"), "reaper", reaper,
            _pod(reaper, [_metrics_part("reaper", reaper, ["reaper"])],
                 grace=reaper("terminationGracePeriodSeconds")),
            replicas=reaper("replicas"))),
    ]



def _pool_each(where: Any = None) -> Each:
    return Each(_root("workers", "pools"), "pool", None, where=where, defaults=_POOL_DEFAULTS)


def _workers() -> list[Doc]:
    """Per pool: the workers (their grace period covers the pool's longest step, so a
    scale-down lets every model call finish instead of cutting it and redoing the job
    elsewhere), their ScaledObject, and the batch lane's batcher."""
    pool = Key("pool")
    worker = _Part("worker", (), "pool")
    batcher = _Part("batcher", ("batcher",), "pool")
    keda_on = Val(("keda", "enabled"), "pool")
    container = _metrics_part("worker", worker, ["worker"], pool=pool, env=[
        {"name": "CALMQ_POOL", "value": pool},
        {"name": "CALMQ_PRIORITIES", "value": Text(worker("priorities"))},
        {"name": "CALMQ_CONCURRENCY", "value": Text(worker("concurrency"))},
        {"name": "CALMQ_GRACE_SECONDS", "value": Text(worker("graceSeconds"))}])
    deployment = _deployment(
        _named("worker-%s", Dashed(pool)), "worker", worker,
        _pod(worker, [container], grace=worker("terminationGracePeriodSeconds")),
        # With KEDA, no replicas: a sync would reset a busy pool to this count.
        replicas=When(Not(keda_on), worker("replicas")), pool=pool)
    scaled: dict[Any, Any] = {
        # Asked for and not served: say so, instead of an apply that fails on a kind the
        # cluster does not know (or, worse, a pool no one scales).
        Check(Fail(Not(Served(keda.API_VERSION)),
                   f"workers: KEDA is enabled but this cluster serves no {keda.API_VERSION}:"
                   " install KEDA, or set workers.poolDefaults.keda.enabled=false (each pool"
                   " then runs its replicas)")): None,
        **keda.scaled_object(_meta(_named("worker-%s", Dashed(pool)), "worker", pool=pool))}
    auth = keda.trigger_authentication(_meta(_named("worker-%s", Dashed(pool)),
                                             "worker", pool=pool))
    batch = _container("batcher", ["batcher", "--metrics-port", str(METRICS_PORT)], batcher,
                       env=[{"name": "CALMQ_POOL", "value": pool}],
                       ports=[{"name": "metrics", "containerPort": METRICS_PORT}],
                       probes=("metrics", "/livez", "/metrics"))
    # A pool's batch lane (`calmq batcher`): one replica packs and polls; pollers share
    # batches by lease and packers claim jobs like workers, so more replicas are safe.
    batcher_deployment = _deployment(
        _named("batcher-%s", Dashed(pool)), "batcher", batcher,
        _pod(batcher, [batch], grace=batcher("terminationGracePeriodSeconds")),
        replicas=batcher("replicas"), pool=pool)

    def named(fmt: str) -> Any:
        return lambda c: fmt % c.scopes["pool"].key

    return [
        Doc(named("60-worker-%s-deployment.yaml"), "workers.yaml", deployment,
            each=_pool_each()),
        Doc(named("60-worker-%s-scaledobject.yaml"), "workers.yaml", scaled,
            each=_pool_each(keda_on)),
        Doc(named("60-worker-%s-triggerauthentication.yaml"), "workers.yaml", auth,
            each=_pool_each(And((keda_on, keda.needs_trigger_authentication())))),
        Doc(named("61-batcher-%s-deployment.yaml"), "workers.yaml", batcher_deployment,
            each=_pool_each(Val(("batcher", "enabled"), "pool"))),
        # Opt-in: a pool that scales to zero, or runs one replica, must not block drains.
        Doc(named("62-worker-%s-pdb.yaml"), "workers.yaml", {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(_named("worker-%s", Dashed(pool)), "worker", pool=pool),
            "spec": {"maxUnavailable": worker("pdb", "maxUnavailable"),
                     "selector": {"matchLabels": _selector("worker", pool)}}},
            each=_pool_each(Val(("pdb", "enabled"), "pool"))),
    ]
