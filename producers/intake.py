"""Turning a validated submission into rows, and writing concurrent submissions together.

``prepare`` builds the new job of a submission; both the API and the client library
(producers.client) use it, so a job enqueued inside a caller's transaction is the same as
one accepted over HTTP (calmq.data.jobs writes it, with its ``job.requested`` event).

``GroupCommit`` is the API's write path for submits without an Idempotency-Key: requests
that arrive while a transaction is in flight share the next one (one WAL flush for many
jobs). A request's future resolves only after COMMIT returned, so its 202 is sent only once
its job is durable; if the batch fails, for whatever reason, each job is retried on its own
so one bad row cannot fail its neighbours: every request of a batch is answered, and a row
whose text PostgreSQL cannot store (a lone surrogate, say from a header byte that is not
UTF-8) is a 400 ``unstorable_text`` for its own request alone (``refusal``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from prometheus_client import Histogram
from psycopg_pool import AsyncConnectionPool

from calmq.data import Idempotency, Store
from calmq.data.jobs import NewJob, insert_jobs
from calmq.errors import ContractError, InfrastructureError
from calmq.group_commit import GroupCommitter
from calmq.jobs import new_id
from calmq.workflows import Workflow

__all__ = ["GroupCommit", "prepare", "refusal", "submit_keyed"]

log = logging.getLogger(__name__)

# How many submits shared each commit: the group-commit effect, visible on /metrics.
BATCH_SIZE = Histogram("calmq_accept_batch_size", "Submits written per group-commit transaction",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))


def prepare(
    workflow: Workflow,
    tenant_id: uuid.UUID,
    *,
    priority: str = "bulk",
    deadline_seconds: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    job_id: uuid.UUID | None = None,
    **columns: Any,
) -> NewJob:
    """The new job of a submission whose input is already validated: at the workflow's
    first step, in that step's pool, with that step's attempt budget.

    ``columns`` are the submission's other fields, each the NewJob field of that name
    (``input``, ``input_ref``, ``callback_url``, ``trace_parent``): a column added to NewJob
    and to the request model reaches the row without an edit here.
    """
    first = workflow.steps[0]
    deadline_seconds = deadline_seconds or workflow.deadline_seconds  # the default
    return NewJob(
        id=job_id or new_id(),
        tenant_id=tenant_id,
        workflow=workflow.name,
        workflow_version=workflow.version,
        priority=priority,
        pool=first.pool or workflow.pool,
        step=first.name,
        max_attempts=first.attempts,
        metadata=dict(metadata or {}),
        deadline_at=(datetime.now(UTC) + timedelta(seconds=deadline_seconds)
                     if deadline_seconds else None),
        **columns,
    )


class GroupCommit:
    """Write concurrent submits in shared transactions; each caller waits for its COMMIT."""

    def __init__(self, pool: AsyncConnectionPool[Any], *, max_batch: int = 256,
                 writers: int = 2) -> None:
        self._pool = pool
        # No window: a submit is written at once when a writer is free; those that arrive
        # while both are busy share the next transaction.
        self._batcher: GroupCommitter[NewJob] = GroupCommitter(
            "accept-group-commit", self._write, max_batch=max_batch, writers=writers)
        self.batches = 0
        self.jobs = 0

    async def submit(self, job: NewJob) -> None:
        """Return once the job is committed; raise InfrastructureError if it was not."""
        await self._batcher.submit(job)

    async def _write(self, rows: list[NewJob]) -> list[BaseException | None] | None:
        try:
            await self._commit(rows)
        except Exception as exc:  # noqa: BLE001 - whatever one row does, each is answered
            if len(rows) == 1:
                return [refusal(exc)]
            log.warning("a group of %d submits failed (%s); writing them one by one",
                        len(rows), type(exc).__name__)
            # Every request gets its own answer, whatever its neighbours' rows do.
            errors: list[BaseException | None] = []
            for job in rows:
                try:
                    await self._commit([job])
                except Exception as one:  # noqa: BLE001 - settles this request alone
                    errors.append(refusal(one))
                else:
                    errors.append(None)
            return errors
        self.batches += 1
        self.jobs += len(rows)
        BATCH_SIZE.observe(len(rows))
        return None

    async def _commit(self, rows: list[NewJob]) -> None:
        async with self._pool.connection() as conn:
            await insert_jobs(conn, rows)


async def submit_keyed(store: Store, job: NewJob, idempotency: Idempotency
                       ) -> tuple[uuid.UUID, bool]:
    """A submit with an Idempotency-Key, in its own transaction (the key row must commit with
    the job), refused by ``refusal``'s rules like a group-committed one."""
    try:
        return await store.jobs.submit(job, idempotency)
    except Exception as exc:
        err = refusal(exc)
        if err is exc:
            raise
        raise err from exc


def refusal(exc: BaseException) -> BaseException:
    """What the request whose row raised ``exc`` is answered with.

    Text the database cannot store is the request's fault (400 ``unstorable_text``): a lone
    surrogate fails in the driver's UTF-8 encoding (UnicodeEncodeError), a NUL or an
    unpaired ``\\u`` escape in PostgreSQL itself (a data exception, SQLSTATE class 22).
    Another database error is the service's (InfrastructureError, 503); anything else is
    returned as it is, a logged 500 for that request alone. No answer repeats the driver's
    text: it is kept as ``__cause__`` for the log.
    """
    err: BaseException
    if isinstance(exc, UnicodeError | psycopg.DataError):
        err = ContractError(
            "the request holds text that cannot be stored (a NUL character, or a character "
            "that is not valid UTF-8)", code="unstorable_text")
    elif isinstance(exc, psycopg.Error):
        err = InfrastructureError("the job could not be written; try again")
    else:
        return exc
    err.__cause__ = exc
    return err
