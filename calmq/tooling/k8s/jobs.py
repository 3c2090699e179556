"""The hook Jobs: the migration, and the Kafka setup (every pool's topics and the
schemas), before anything else of a release starts."""

from __future__ import annotations

from typing import Any

from calmq.tooling.k8s.objects import (
    _POOL_DEFAULTS,
    _container,
    _labels,
    _meta,
    _named,
    _Part,
    _pod,
    _root,
    _when_set,
)
from calmq.tooling.manifests import Dashed, Doc, Each, Key, Printf, Spread, When


def _hooks(weight: int) -> dict[str, str]:
    """A Job that runs before the release's other objects change, and again with each
    upgrade: a Helm pre-install/pre-upgrade hook and an Argo CD PreSync hook, deleted
    before the next one is created (a finished Job's pod template cannot change)."""
    return {
        "helm.sh/hook": "pre-install,pre-upgrade",
        "helm.sh/hook-weight": str(weight),
        "helm.sh/hook-delete-policy": "before-hook-creation",
        "argocd.argoproj.io/hook": "PreSync",
        "argocd.argoproj.io/hook-delete-policy": "BeforeHookCreation",
        "argocd.argoproj.io/sync-wave": str(weight),
    }


_JOBS = _Part("jobs", ("jobs",))


def _job(name: Any, component: str, containers: list[Any], weight: int, key: str
         ) -> dict[str, Any]:
    # jobs.<key>.hook false: a plain Job, for tools that apply a chart's objects without
    # running hooks (Flux's and Terraform's helm releases can; a GitOps render cannot).
    hook = _JOBS(key, "hook")
    annotations = {k: When(hook, v) for k, v in _hooks(weight).items()}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _meta(name, component, _JOBS, annotations=annotations),
        "spec": {
            "backoffLimit": _JOBS("backoffLimit"),
            # Kept a day for its logs; the next release's hook deletes it first anyway.
            "ttlSecondsAfterFinished": _JOBS("ttlSecondsAfterFinished"),
            "template": {
                "metadata": {"labels": {**_labels(component), Spread(_JOBS("podLabels")): None},
                             "annotations": _when_set(_JOBS("podAnnotations"), block=True)},
                # No ServiceAccount of the release: a hook runs before it exists.
                "spec": _pod(_JOBS, containers, grace=30, restart="OnFailure",
                             service_account=_JOBS("serviceAccountName"),
                             component=component)},
        },
    }


def _jobs() -> list[Doc]:
    pool = Key("pool")
    migrate = _container("migrate", ["migrate"], _Part("migrate", ("jobs",)),
                         inline_config=True)
    topics = Each(_root("workers", "pools"), "pool", _container(
        Printf("topics-%s", Dashed(pool)), ["topics", "create", "--pool", pool],
        _Part("kafka-setup", ("jobs",)), inline_config=True), defaults=_POOL_DEFAULTS)
    schemas = _container("schemas", ["schemas", "register"], _Part("kafka-setup", ("jobs",)),
                         inline_config=True)
    return [
        Doc(lambda _c: "jobs/20-migrate-job.yaml", "job-migrate.yaml",
            _job(_named("migrate"), "migrate", [migrate], -10, "migrate")),
        # Topics of every pool and the schemas, before any producer or consumer starts.
        # Each is idempotent, so the Job runs again with every release.
        Doc(lambda _c: "jobs/21-kafka-setup-job.yaml", "job-kafka-setup.yaml",
            _job(_named("kafka-setup"), "kafka-setup", [topics, schemas], -5, "kafkaSetup")),
    ]
