"""Dead letters: the dead-lettered jobs' records, and the redrive that queues one again.

The redrive is one statement guarded by ``status = 'dead_letter'`` (calmq/sql/deadletters.sql,
``dlq_requeue``): it archives the round's attempts, writes the ``redriven`` event and
queues the job; its ``job.requested`` is written through the outbox in the same
transaction. Whether a job may be redriven, and with which budget, is calmq.deadletters'.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from calmq.data import outbox
from calmq.data.database import Database
from calmq.data.jobs import requested
from calmq.errors import ContractError

__all__ = ["DeadJob", "DeadLetter", "DeadLetterGroup", "DeadLetterRecords", "Redriven"]

# The waiting reason of a child past its parent's in-flight limit (insert_children,
# children_requeue_failed).
PARENT_IN_FLIGHT = "parent_in_flight"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A dead-lettered job as listed (the columns of dlq_list)."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    tenant: str
    workflow: str
    workflow_version: int
    priority: str
    pool: str
    step: str
    attempt: int
    error: dict[str, Any] | None
    created_at: datetime
    dead_lettered_at: datetime


@dataclass(frozen=True, slots=True)
class DeadLetterGroup:
    """Dead letters that died at one workflow step of one failure (dlq_summary's columns)."""

    workflow: str
    step: str
    failure_class: str | None
    code: str | None
    count: int
    oldest: datetime
    newest: datetime


@dataclass(frozen=True, slots=True)
class DeadJob:
    """What a redrive reads of a job (in any status: it may not be a dead letter)."""

    id: uuid.UUID
    status: str
    workflow: str
    step: str
    input: dict[str, Any] | None
    input_ref: str | None
    deadline_at: datetime | None
    error: dict[str, Any] | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> DeadJob:
        return cls(row["id"], row["status"], row["workflow"], row["step"], row["input"],
                   row["input_ref"], row["deadline_at"], row["error"])


@dataclass(frozen=True, slots=True)
class Redriven:
    """A job queued again: at ``step``, in redrive ``round`` (1 for the first)."""

    id: uuid.UUID
    step: str
    round: int


class DeadLetterRecords:
    def __init__(self, db: Database, *, children_in_flight: int) -> None:
        self._db = db
        # Setting children_in_flight_max: a redriven parent's failed children past it wait
        # for earlier ones, as a spawn's do.
        self._children_in_flight = children_in_flight

    async def find(self, filters: Mapping[str, Any],
                   after: tuple[datetime, uuid.UUID] | None = None) -> list[DeadLetter]:
        """Dead-lettered jobs matching ``filters`` (every ``dlq_list`` parameter; None: no
        filter), oldest death first, after the (dead_lettered_at, id) ``after`` if given."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["dlq_list"], _keyset(filters, after))
            return [DeadLetter(**r) for r in await cur.fetchall()]

    async def count(self, filters: Mapping[str, Any],
                    after: tuple[datetime, uuid.UUID] | None = None) -> int:
        """How many dead letters ``find`` would page through (any number, no limit)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["dlq_count"], _keyset(filters, after))
            row = await cur.fetchone()
        return int(row["n"]) if row is not None else 0

    async def summary(self, filters: Mapping[str, Any]) -> list[DeadLetterGroup]:
        """The matching dead letters grouped by workflow, step, failure class and code."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["dlq_summary"], filters)
            return [DeadLetterGroup(**r) for r in await cur.fetchall()]

    async def record(self, job_id: uuid.UUID, tenant_id: uuid.UUID | None) -> DictRow | None:
        """The whole record of a job: its row, ``attempts`` of every round (round 0 the
        current one) and ``events``; None for an unknown job or another tenant's."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["dlq_job"], {"id": job_id, "tenant_id": tenant_id})
            job = await cur.fetchone()
            if job is None:
                return None
            cur = await conn.execute(self._db.q["dlq_attempts"], {"id": job_id})
            job["attempts"] = [{"round": r["round"], **r["record"]}
                               for r in await cur.fetchall()]
            cur = await conn.execute(self._db.q["dlq_events"], {"id": job_id})
            job["events"] = await cur.fetchall()
        return job

    async def job(self, job_id: uuid.UUID, tenant_id: uuid.UUID | None) -> DeadJob | None:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["dlq_job"], {"id": job_id, "tenant_id": tenant_id})
            row = await cur.fetchone()
        return DeadJob.from_row(row) if row is not None else None

    async def requeue(
        self, job_id: uuid.UUID, *, detail: dict[str, Any], workflow_version: int, pool: str,
        max_attempts: int,
    ) -> Redriven | None:
        """Queue a dead letter again with its ``job.requested``; None if it is no longer a
        dead letter (redriven or cancelled by someone else meanwhile): nothing is written."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._db.q["dlq_requeue"], {
                "id": job_id, "detail": Jsonb(detail), "workflow_version": workflow_version,
                "pool": pool, "max_attempts": max_attempts})
            row = await cur.fetchone()
            if row is None:
                return None
            # A parent whose join failed waits for its failed children again, run anew; the
            # children that succeeded keep their outputs (calmq.data.children).
            # Its children still in flight are locked first: none ends before this commits,
            # so each one's end sees the re-armed join and what this redrive held back.
            await conn.execute(self._db.q["children_hold_settling"], {"id": job_id})
            cur = await conn.execute(self._db.q["children_rearm"], {"id": job_id})
            join = await cur.fetchone()
            if join is not None:
                needed = join["n"] if join["policy"] == "all" else join["k"]
                if join["n"] - join["failed"] < needed:  # its cancelled children: never
                    raise ContractError(
                        f"{join['failed']} of the job's {join['n']} children were cancelled: "
                        f"its join ({join['policy']}) can no longer hold",
                        code="children_cancelled", status=409)
                cur = await conn.execute(self._db.q["children_requeue_failed"], {
                    "id": job_id, "step": join["step"],
                    "in_flight": self._children_in_flight})
                await self._send_children(conn, job_id, await cur.fetchall())
                return Redriven(row["id"], row["step"], row["round"])
            # Through the one job.requested builder: a redriven job keeps its lane.
            await outbox.insert(conn, [requested(row)])
        return Redriven(row["id"], row["step"], row["round"])

    async def _send_children(self, conn: Any, parent_id: uuid.UUID,
                             children: list[DictRow]) -> None:
        """Each requeued child's job.requested: into the outbox, or, for one past the
        in-flight limit (children_requeue_failed held it), into job_held_children."""
        go, held = [], []
        for child in children:
            event = requested(child)
            if child["waiting_reason"] == PARENT_IN_FLIGHT:
                held.append({"job_id": str(child["id"]), "child_index": child["child_index"],
                             "route": event.route, "payload": event.payload,
                             "headers": event.headers})
            else:
                go.append(event)
        if go:
            await outbox.insert(conn, go)
        if held:
            await conn.execute(self._db.q["children_hold_requeued"],
                               {"parent_id": parent_id, "rows": Jsonb(held)})


def _keyset(filters: Mapping[str, Any], after: tuple[datetime, uuid.UUID] | None
            ) -> dict[str, Any]:
    at, ident = after if after is not None else (None, None)
    return {**filters, "after_at": at, "after_id": ident}
