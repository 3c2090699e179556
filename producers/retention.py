"""Deleting a job's data: on request (DELETE /v1/jobs/{id}) and by age (the retention sweep).

A purge deletes the job's objects first (its input, its artifact, every object its step
outputs name, the artifacts of its steps and of each of their attempts -- also of a stale
attempt, which no row names -- and the folder its steps write to: embed_document's chunks
and vectors), then redacts its row and every row about it (calmq.data.retention's
``COVERAGE``: step outputs, reviewed fields, attempt errors, redriven attempts, side-effect
responses, webhook URLs and errors, idempotency keys, unpublished events), keeping ids,
times, statuses and token/cost numbers for audit and accounting. Objects first: if the
process dies in between, the row still names them and the next purge finishes the work;
the reverse order could leave objects nobody points at. A job's descendants (child jobs,
at every level) go before it, a batch at a time, deepest first (``_purge_children``).

The retention sweep does the same for every terminal job past retention, a batch of a
thousand at a time (one statement per table for the batch), except for the history rows:
job_events and job_attempts are partitioned by time, and a partition is dropped whole once
every job with history in it is past retention (calmq.data.partitions). A partition past the
retention that a job still open (or ended lately) holds back loses the rows of its other
jobs, past retention, instead: retention is each job's and each tenant's own, never held by
another tenant's oldest open job. The sweep also makes the partitions ahead of now that
inserts will need.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from functools import cache

from prometheus_client import Counter

from calmq.data import Database
from calmq.data.children import Children
from calmq.data.partitions import HistoryPartitions
from calmq.data.retention import ExpiredJob, JobData, Retention
from calmq.errors import ContractError, NotFound
from calmq.jobs import TERMINAL
from calmq.objects import ObjectStore
from calmq.producers.uploads import delete_folder, delete_object, object_uri, tenant_owns
from calmq.settings import Settings
from calmq.workflows.progress import artifact_key

__all__ = ["Sweeper", "delete_objects", "purge", "retention_counters"]


@cache
def retention_counters() -> tuple[Counter, Counter]:
    """(jobs retired, history partitions dropped) by the retention sweep."""
    return (Counter("calmq_retention_jobs_retired_total",
                    "Terminal jobs past retention whose objects were deleted and record "
                    "redacted by the retention sweep"),
            Counter("calmq_retention_partitions_dropped_total",
                    "Time partitions of job_events and job_attempts dropped whole by "
                    "retention"))

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
    # Its child jobs first (a step of it started them: calmq.data.children), each purged
    # the same way, their own children too; one not ended yet is cancelled first. The parent
    # last: a purge that died half way is finished by a repeat, which still finds them.
    await _purge_children(db, objects, settings, tenant_id, job_id)
    # A repeat is not skipped: it finishes a purge that died half way, or one made before
    # deletion covered every table and object (the work is idempotent).
    await delete_objects(objects, settings, tenant_id, job_id, job)
    await retention.redact(tenant_id, job_id)


# A deleted job's descendants are purged this many at a time: a batch's objects deleted
# (this many deletions at once), then its rows redacted in one transaction of a statement
# per table; a job with 500 children costs the statements of one batch, not 500 purges.
_TREE_BATCH = 1000
_OBJECT_DELETES = 16


async def _purge_children(db: Database, objects: ObjectStore, settings: Settings,
                          tenant_id: uuid.UUID, job_id: uuid.UUID) -> None:
    """Every descendant of the job, at every level, set-based: those not ended cancelled in
    one transaction (with their job.result, as a cancel of each writes it), then a batch at
    a time, deepest first, their objects deleted and their rows redacted. A purge that dies
    half way leaves no redacted job with a descendant that is not, and a repeat (which lists
    the redacted ones again) finishes it."""
    retention = Retention(db)
    await Children(db).cancel_tree(tenant_id, job_id, by="its parent was deleted")
    tree = await retention.tree(tenant_id, job_id)
    room = asyncio.Semaphore(_OBJECT_DELETES)

    async def objects_of(job: ExpiredJob) -> None:
        async with room:
            await delete_objects(objects, settings, tenant_id, job.job_id, job.data)

    for start in range(0, len(tree), _TREE_BATCH):
        batch = await retention.jobs_data(tenant_id, tree[start:start + _TREE_BATCH])
        left = [job for job in batch if job.data.status not in TERMINAL]
        if left:  # started after the cancel (a spawn that committed in between): not yet
            raise ContractError(f"a child job of it ({left[0].job_id}) is "
                                f"{left[0].data.status}; delete the job again",
                                code="job_not_terminal", status=409)
        await asyncio.gather(*(objects_of(job) for job in batch))
        await retention.redact_tree(tenant_id, [job.job_id for job in batch])


async def delete_objects(objects: ObjectStore, settings: Settings, tenant_id: uuid.UUID,
                         job_id: uuid.UUID, job: JobData) -> None:
    """Every object of the job: its input, artifact and what its step outputs name, each
    step's and attempt's artifact, and its steps' folder."""
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


class Sweeper:
    """Retention: old idempotency keys, old terminal jobs' data and the history partitions
    past retention, one ``sweep`` a pass (every ``interval`` seconds, in the API)."""

    # Jobs a batch reads and redacts in one transaction, and how many of a batch's jobs have
    # their objects deleted at once (each deletion waits on the store: a file system call or
    # an S3 request).
    BATCH = 1000
    OBJECT_DELETES = 16

    def __init__(self, settings: Settings, db: Database, objects: ObjectStore,
                 interval: float = 60.0) -> None:
        self._settings = settings
        self._db = db
        self._retention = Retention(db)
        self._partitions = HistoryPartitions(db)
        self._objects = objects
        self.interval = interval  # between sweeps, run as a side task (calmq.supervision)
        # A pass goes on while jobs past retention remain, up to this long: retention keeps
        # pace with any intake the database takes, and one pass never holds the loop for ever.
        self.pass_seconds = 10 * interval

    async def sweep(self) -> dict[str, int]:
        """One pass; returns how many keys were pruned, jobs purged, partitions made and
        dropped, and history rows deleted from partitions an open job holds back."""
        keys = await self._retention.prune_idempotency_keys(
            self._settings.idempotency_retention_seconds)
        # Partitions ahead first: an insert that finds none fails.
        made = await self._partitions.make_ahead(self._settings.history_partition_hours,
                                                 self._settings.history_partitions_ahead)
        purged = dropped = expired = 0
        retention = self._settings.job_retention_seconds
        if retention > 0:
            purged = await self._retire_jobs(retention)
            dropped = len(await self._partitions.retire(retention))
            expired = await self._partitions.expire(retention, seconds=self.pass_seconds)
        retired, gone = retention_counters()
        retired.inc(purged)
        gone.inc(dropped)
        return {"idempotency_keys": keys, "jobs": purged, "partitions_made": made,
                "partitions_dropped": dropped, "history_rows_expired": expired}

    async def _retire_jobs(self, retention: float) -> int:
        """Batches of jobs past retention: objects deleted, then the rows redacted."""
        purged = 0
        deadline = time.monotonic() + self.pass_seconds
        room = asyncio.Semaphore(self.OBJECT_DELETES)

        async def objects_of(job: ExpiredJob) -> None:
            async with room:
                await delete_objects(self._objects, self._settings, job.tenant_id,
                                     job.job_id, job.data)

        while time.monotonic() < deadline:
            batch = await self._retention.expired(retention, self.BATCH)
            if not batch:
                break
            await asyncio.gather(*(objects_of(job) for job in batch))
            purged += await self._retention.redact_expired([job.job_id for job in batch])
            if len(batch) < self.BATCH:
                break
        return purged
