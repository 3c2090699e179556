"""Human review: jobs waiting in ``awaiting_review``, and the writes of one decision.

A decision is one transaction (``Reviews.decision``): the job is locked, its step output
is marked approved or rejected, and the job moves on with its history event and outbox
entries, all on the same connection. What a decision does is calmq.reviews'.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from calmq.data import outbox
from calmq.data.database import Connection, Database
from calmq.data.outbox import OutboxEntry

__all__ = ["PendingReview", "ReviewDecision", "ReviewJob", "Reviews"]


@dataclass(frozen=True, slots=True)
class PendingReview:
    """A job waiting for a person, with what the model said (wf_pending_reviews)."""

    id: uuid.UUID
    workflow: str
    step: str
    review_deadline_at: datetime | None
    updated_at: datetime  # when it entered awaiting_review
    created_at: datetime
    output: dict[str, Any]
    confidence: float | None


@dataclass(frozen=True, slots=True)
class ReviewJob:
    """A job locked for a decision (the columns wf_lock_job returns)."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    workflow: str
    workflow_version: int
    status: str
    priority: str
    pool: str
    step: str
    attempt: int
    input_ref: str | None
    deadline_at: datetime | None
    created_at: datetime
    trace_parent: str | None
    review_deadline_at: datetime | None
    updated_at: datetime | None
    # Carried into the job's result event (correlation and usage for consumers).
    metadata: dict[str, Any]
    input_tokens: int
    output_tokens: int
    cost_usd: Decimal

    @classmethod
    def from_row(cls, row: DictRow) -> ReviewJob:
        return cls(**row)


class ReviewDecision:
    """The statements of one decision, on the connection of its transaction."""

    def __init__(self, db: Database, conn: Connection) -> None:
        self._q = db.q
        self._keep_errors = db.keep_errors
        self.conn = conn

    async def lock(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> ReviewJob | None:
        """The tenant's job, locked until the decision commits; None if it is not theirs."""
        cur = await self.conn.execute(self._q["wf_lock_job"],
                                      {"id": job_id, "tenant_id": tenant_id})
        row = await cur.fetchone()
        return ReviewJob.from_row(row) if row is not None else None

    async def lock_expired(self, job_id: uuid.UUID) -> ReviewJob | None:
        """The job if its review is still past its deadline and nobody holds it right now."""
        cur = await self.conn.execute(self._q["wf_lock_expired_review"], {"id": job_id})
        row = await cur.fetchone()
        return ReviewJob.from_row(row) if row is not None else None

    async def step_output(self, job: ReviewJob) -> dict[str, Any] | None:
        """The output recorded for the job's current step (locked), if any."""
        cur = await self.conn.execute(self._q["wf_lock_step_output"],
                                      {"job_id": job.id, "step": job.step})
        row = await cur.fetchone()
        return dict(row["output"]) if row is not None else None

    async def set_step_output(self, job: ReviewJob, state: str, output: dict[str, Any],
                              reviewer: str) -> None:
        await self.conn.execute(self._q["wf_review_step_output"],
                                {"job_id": job.id, "step": job.step, "state": state,
                                 "output": Jsonb(output), "reviewer": reviewer})

    async def resume(self, job: ReviewJob, next_step: str, pool: str,
                     max_attempts: int) -> DictRow:
        """Queue the job at ``next_step``; the moved row (what ``job.requested`` carries)."""
        cur = await self.conn.execute(self._q["wf_review_resume"],
                                      {"id": job.id, "next_step": next_step, "pool": pool,
                                       "max_attempts": max_attempts})
        moved = await cur.fetchone()
        assert moved is not None  # the job is locked by this transaction
        return moved

    async def complete(self, job: ReviewJob, artifact: dict[str, Any]) -> None:
        await self.conn.execute(self._q["wf_review_complete"],
                                {"id": job.id, "artifact": Jsonb(artifact)})

    async def dead_letter(self, job: ReviewJob, error: dict[str, Any]) -> None:
        await self.conn.execute(self._q["wf_review_dead_letter"],
                                {"id": job.id, "error": Jsonb(error),
                                 "keep_errors": self._keep_errors})

    async def add_event(self, job: ReviewJob, type_: str, detail: dict[str, Any]) -> None:
        """A history event of the job at its current attempt."""
        await self.conn.execute(self._q["wf_insert_event"],
                                {"job_id": job.id, "type": type_, "attempt": job.attempt,
                                 "detail": Jsonb(detail)})

    async def emit(self, entries: Sequence[OutboxEntry]) -> None:
        """Outbox entries that commit with the decision."""
        await outbox.insert(self.conn, entries)


class Reviews:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def pending(self, tenant_id: uuid.UUID, *, limit: int, after_at: datetime,
                      after_id: uuid.UUID) -> list[PendingReview]:
        """The tenant's jobs awaiting review after ``(after_at, after_id)``, oldest first,
        with the model's output."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["wf_pending_reviews"],
                                     {"tenant_id": tenant_id, "limit": limit,
                                      "after_at": after_at, "after_id": after_id})
            return [PendingReview(**r) for r in await cur.fetchall()]

    async def expired(self, limit: int) -> list[uuid.UUID]:
        """Jobs whose review deadline passed, earliest deadline first."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["wf_expired_reviews"], {"limit": limit})
            return [r["id"] for r in await cur.fetchall()]

    @asynccontextmanager
    async def decision(self) -> AsyncIterator[ReviewDecision]:
        """One decision's transaction: it commits when the block ends without an error."""
        async with self._db.pool.connection() as conn, conn.transaction():
            yield ReviewDecision(self._db, conn)
