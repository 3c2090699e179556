"""Turning a validated submission into rows, and writing concurrent submissions together.

``prepare`` builds the job, its ``job.requested`` event and its route; both the API and the
client library (producers.client) use it, so a job enqueued inside a caller's transaction
is the same as one accepted over HTTP.

``GroupCommit`` is the API's write path for submits without an Idempotency-Key: requests
that arrive while a transaction is in flight share the next one (one WAL flush for many
jobs). A request's future resolves only after COMMIT returned, so its 202 is sent only once
its job is durable; if the batch fails, each job is retried on its own so one bad row
cannot fail its neighbours.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from prometheus_client import Histogram
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from calmq import events, sql, topics
from calmq.batching import Batcher
from calmq.errors import InfrastructureError
from calmq.store import NewJob, insert_job_params
from calmq.workflows import Workflow

__all__ = ["GroupCommit", "Prepared", "insert_params", "prepare"]

log = logging.getLogger(__name__)

# How many submits shared each commit: the group-commit effect, visible on /metrics.
BATCH_SIZE = Histogram("calmq_accept_batch_size", "Submits written per group-commit transaction",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))

Prepared = tuple[NewJob, dict[str, Any], str]


def prepare(
    workflow: Workflow,
    tenant_id: uuid.UUID,
    *,
    input: dict[str, Any] | None = None,
    input_ref: str | None = None,
    priority: str = "bulk",
    deadline_seconds: int | None = None,
    callback_url: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    trace_parent: str | None = None,
    idempotency_key: str | None = None,
    request_hash: bytes | None = None,
    job_id: uuid.UUID | None = None,
) -> Prepared:
    """The job row, its first event and its Kafka route, for an input already validated."""
    first = workflow.steps[0]
    job = NewJob(
        id=job_id or uuid.uuid4(),
        tenant_id=tenant_id,
        workflow=workflow.name,
        workflow_version=workflow.version,
        priority=priority,
        pool=first.pool or workflow.pool,
        step=first.name,
        max_attempts=first.attempts,
        input=input,
        input_ref=input_ref,
        metadata=dict(metadata or {}),
        callback_url=callback_url,
        deadline_at=(datetime.now(UTC) + timedelta(seconds=deadline_seconds)
                     if deadline_seconds else None),
        trace_parent=trace_parent,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
    )
    row = {"id": job.id, "tenant_id": job.tenant_id, "workflow": job.workflow,
           "workflow_version": job.workflow_version, "step": job.step, "attempt": 0,
           "priority": job.priority, "pool": job.pool, "input_ref": job.input_ref,
           "deadline_at": job.deadline_at, "trace_parent": job.trace_parent}
    event = events.requested(row)
    event.pop("created_at")  # the database's commit-side clock fills it in
    return job, event, topics.work_route(job.pool, job.priority)


# The same parameters serve the API's group commit, enqueue() and Store.submit.
insert_params = insert_job_params


def request_hash(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()


class GroupCommit:
    """Write concurrent submits in shared transactions; each caller waits for its COMMIT."""

    def __init__(self, pool: AsyncConnectionPool[Any], *, max_batch: int = 256,
                 writers: int = 2) -> None:
        self._pool = pool
        self._query = sql.queries()["insert_job"]
        self._batch_query = sql.queries()["api_insert_jobs"]
        # No window: a submit is written at once when a writer is free; those that arrive
        # while both are busy share the next transaction.
        self._batcher: Batcher[dict[str, Any]] = Batcher(
            "accept-group-commit", self._write, max_batch=max_batch, writers=writers)
        self.batches = 0
        self.jobs = 0

    async def submit(self, params: dict[str, Any]) -> None:
        """Return once the job is committed; raise InfrastructureError if it was not."""
        await self._batcher.submit(params)

    async def _write(self, rows: list[dict[str, Any]]) -> list[BaseException | None] | None:
        try:
            await self._commit(rows)
        except psycopg.Error as exc:
            if len(rows) == 1:
                return [_infrastructure(exc)]
            log.warning("a group of %d submits failed (%s); writing them one by one",
                        len(rows), exc)
            # Every request gets its own answer, whatever its neighbours' rows do.
            errors: list[BaseException | None] = []
            for params in rows:
                try:
                    await self._commit([params])
                except psycopg.Error as one:
                    errors.append(_infrastructure(one))
                else:
                    errors.append(None)
            return errors
        self.batches += 1
        self.jobs += len(rows)
        BATCH_SIZE.observe(len(rows))
        return None

    async def _commit(self, rows: list[dict[str, Any]]) -> None:
        async with self._pool.connection() as conn:
            if len(rows) == 1:
                await conn.execute(self._query, rows[0])
            else:
                await conn.execute(self._batch_query, {"jobs": Jsonb([_plain(r) for r in rows])})


def _plain(params: dict[str, Any]) -> dict[str, Any]:
    """insert_params as JSON values for jsonb_to_recordset (Jsonb wrappers unwrapped)."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        if isinstance(value, Jsonb):
            out[name] = value.obj
        elif isinstance(value, uuid.UUID):
            out[name] = str(value)
        elif isinstance(value, datetime):
            out[name] = value.isoformat()
        else:
            out[name] = value
    return out


def _infrastructure(exc: psycopg.Error) -> InfrastructureError:
    err = InfrastructureError(f"the job could not be written: {exc}")
    err.__cause__ = exc
    return err
