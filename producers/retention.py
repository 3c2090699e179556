"""Deleting a job's data: on request (DELETE /v1/jobs/{id}) and by age (the retention sweep).

A purge deletes the job's objects first (its input, its artifact, every object its step
outputs name, the artifacts of its steps and of each of their attempts -- also of a stale
attempt, which no row names -- and the folder its steps write to: embed_document's chunks
and vectors), then redacts its row and every row about it (calmq.data.retention's
``COVERAGE``: step outputs, reviewed fields, attempt errors, redriven attempts, side-effect
responses, webhook URLs and errors, idempotency keys, unpublished events), keeping ids,
times, statuses and token/cost numbers for audit and accounting. Objects first: if the
process dies in between, the row still names them and the next purge finishes the work;
the reverse order could leave objects nobody points at.
"""

from __future__ import annotations

import contextlib
import uuid

from calmq.data import Database
from calmq.data.retention import Retention
from calmq.errors import ContractError, NotFound
from calmq.jobs import TERMINAL
from calmq.objects import ObjectStore
from calmq.producers.uploads import delete_folder, delete_object, object_uri, tenant_owns
from calmq.settings import Settings
from calmq.workflows.progress import artifact_key

__all__ = ["Sweeper", "purge"]

async def purge(db: Database, objects: ObjectStore, settings: Settings,
                tenant_id: uuid.UUID, job_id: uuid.UUID) -> None:
    """Delete a terminal job's objects and redact its record; NotFound, or 409 if not terminal."""
    retention = Retention(db)
    job = await retention.job_data(tenant_id, job_id)
    if job is None:
        raise NotFound("no such job")
    if job.status not in TERMINAL:
        raise ContractError(f"the job is {job.status}; cancel it before deleting it",
                            code="job_not_terminal", status=409)
    # A repeat is not skipped: it finishes a purge that died half way, or one made before
    # deletion covered every table and object (the work is idempotent).
    # Only objects inside the tenant's own prefix: an input_ref is checked at submit, but
    # a purge must never be the way to delete something else.
    uris = job.object_uris()
    # Each step's artifact, also one no row names any more: the one a review completed, and
    # each attempt's (keyed by its fencing token; a stale attempt's is named by no row).
    keys = [artifact_key(tenant_id, job_id, step) for step in {*job.steps}]
    keys += [artifact_key(tenant_id, job_id, step, version) for step, version in job.attempts]
    for key in keys:
        uri = object_uri(objects, key)
        if uri is not None:
            uris.add(uri)
    for uri in sorted(uris):
        if tenant_owns(settings.object_store_url, tenant_id, uri):
            await delete_object(objects, uri)
    await delete_folder(objects, f"{tenant_id}/{job_id}")  # StepContext.object_key's folder
    await retention.redact(tenant_id, job_id)


class Sweeper:
    """Retention: old idempotency keys and old terminal jobs' data, one ``sweep`` a pass."""

    def __init__(self, settings: Settings, db: Database, objects: ObjectStore,
                 interval: float = 60.0) -> None:
        self._settings = settings
        self._db = db
        self._retention = Retention(db)
        self._objects = objects
        self.interval = interval  # between sweeps, run as a side task (calmq.supervision)

    async def sweep(self, limit: int = 500) -> dict[str, int]:
        """One pass; returns how many keys were pruned and jobs purged."""
        keys = await self._retention.prune_idempotency_keys(
            self._settings.idempotency_retention_seconds)
        purged = 0
        if self._settings.job_retention_seconds > 0:
            expired = await self._retention.expired_jobs(self._settings.job_retention_seconds,
                                                         limit)
            for tenant_id, job_id in expired:
                with contextlib.suppress(NotFound, ContractError):
                    await purge(self._db, self._objects, self._settings, tenant_id, job_id)
                    purged += 1
        return {"idempotency_keys": keys, "jobs": purged}
