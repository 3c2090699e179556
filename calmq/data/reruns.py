"""Reruns from a step: the job a rerun starts from, and the statement that writes the rerun.

A rerun is a new job (``jobs.rerun_of`` names the original) written by one statement
(calmq/sql/reruns.sql, ``rerun_insert_job``): the row, its ``queued`` event naming the
original, the recorded outputs of the steps before the one it starts at (copied from the
original, so a worker skips those steps: calmq.workflows.progress) and its
``job.requested``. The original is read ``FOR SHARE`` in the same statement, so a purge
cannot redact it between the checks and the copy. Whether a job may be rerun is
calmq.reruns'.

Round trips: reading the original (its row and recorded steps) is one, writing a rerun
without an ``Idempotency-Key`` one more (the statement is its own transaction); a bulk
rerun of thousands (``calmq jobs rerun``) makes two a job, where it made seven, so its own
work on the database and in the CLI stays small beside the jobs it starts.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from calmq.data.database import Database
from calmq.data.jobs import Idempotency, NewJob, _insert_params, insert_keyed, keyed_job

__all__ = ["Original", "RerunMatch", "RerunRecords", "RerunSearch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Original:
    """The job a rerun starts from (the columns of ``rerun_original``) and the steps it has
    a final recorded output of."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    workflow: str
    workflow_version: int
    status: str
    priority: str
    lane: str
    input: dict[str, Any] | None
    input_ref: str | None
    metadata: dict[str, Any]
    callback_url: str | None
    deadline_at: datetime | None
    created_at: datetime
    trace_parent: str | None
    concurrency_key: str | None
    redacted_at: datetime | None
    recorded: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class RerunSearch:
    """Which ended jobs a bulk rerun takes (None: any), newest first after the cursor.
    ``steps``: the steps the rerun runs again, whose recorded cost is the estimate."""

    workflow: str
    statuses: Sequence[str]
    created_before: datetime
    steps: Sequence[str] = ()
    tenant: str | None = None
    code: str | None = None
    metadata: dict[str, Any] | None = None
    created_after: datetime | None = None
    cursor_at: datetime | None = None
    cursor_id: uuid.UUID | None = None
    limit: int = 500

    def params(self) -> dict[str, Any]:
        return {"workflow": self.workflow, "statuses": list(self.statuses),
                "created_before": self.created_before, "steps": list(self.steps),
                "tenant": self.tenant, "code": self.code,
                "metadata": None if self.metadata is None else Jsonb(self.metadata),
                "created_after": self.created_after, "cursor_at": self.cursor_at,
                "cursor_id": self.cursor_id, "limit": self.limit}


@dataclass(frozen=True, slots=True)
class RerunMatch:
    id: uuid.UUID
    tenant_id: uuid.UUID
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Estimate:
    """How many jobs match, and what their attempts of the steps to run again cost."""

    jobs: int
    cost_usd: float
    tokens: int
    calls: int = 0  # the attempts those steps made (a request budget's unit)


class RerunRecords:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def original(self, job_id: uuid.UUID, tenant_id: uuid.UUID | None) -> Original | None:
        """The job (a tenant's own when ``tenant_id`` is given) and its recorded steps."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["rerun_original"],
                                     {"id": job_id, "tenant_id": tenant_id})
            row = await cur.fetchone()
        if row is None:
            return None
        return Original(**{**row, "recorded": frozenset(row["recorded"] or ())})

    async def create(self, job: NewJob, *, rerun_of: uuid.UUID, detail: dict[str, Any],
                     copy_steps: Sequence[str], replaced_step: str | None,
                     replacement: dict[str, Any] | None,
                     idempotency: Idempotency | None = None) -> tuple[uuid.UUID, bool] | None:
        """Write the rerun in one transaction, with its ``Idempotency-Key`` if given (the
        key row commits with the job, as a keyed submit's: calmq.data.jobs.Jobs.submit).
        Returns ``(job id, created)``: the new job's, or with a key seen before and the same
        request, the earlier rerun's and ``False`` (a different request under the key:
        ContractError 409 ``idempotency_key_reused``). None when the original is gone
        (purged or deleted since it was read): nothing is written then."""
        params = _insert_params(job)
        params.update(rerun_of=rerun_of, detail=Jsonb(detail), copy_steps=list(copy_steps),
                      replaced_step=replaced_step,
                      replacement=None if replacement is None else Jsonb(replacement))
        async with self._db.pool.connection() as conn:
            if idempotency is None:  # one statement, its own transaction: one round trip
                cur = await conn.execute(self._db.q["rerun_insert_job"], params)
                return (job.id, True) if await cur.fetchone() is not None else None

            async def insert() -> bool:
                cur = await conn.execute(self._db.q["rerun_insert_job"], params)
                return await cur.fetchone() is not None

            return await insert_keyed(conn, self._db.q, job.tenant_id, job.id, idempotency,
                                      insert=insert)

    async def earlier(self, tenant_id: uuid.UUID, idempotency: Idempotency
                      ) -> uuid.UUID | None:
        """The job an ``Idempotency-Key`` answered before (a submit's or a rerun's: one
        key space per tenant), None for a new key; ContractError 409
        ``idempotency_key_reused`` when it came with another request."""
        async with self._db.pool.connection() as conn:
            return await self._earlier(conn, tenant_id, idempotency)

    async def _earlier(self, conn: Any, tenant_id: uuid.UUID, idempotency: Idempotency
                       ) -> uuid.UUID | None:
        return await keyed_job(conn, self._db.q, tenant_id, idempotency)

    async def cost(self, job_id: uuid.UUID, steps: Sequence[str]) -> tuple[float, int]:
        """What the job's attempts of ``steps`` cost: (USD, tokens)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["rerun_cost"],
                                     {"id": job_id, "steps": list(steps)})
            row = await cur.fetchone()
        return (float(row["cost_usd"]), int(row["tokens"])) if row else (0.0, 0)

    async def matches(self, which: RerunSearch) -> list[RerunMatch]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["rerun_matches"], which.params())
            return [RerunMatch(r["id"], r["tenant_id"], r["created_at"])
                    for r in await cur.fetchall()]

    async def estimate(self, which: RerunSearch) -> Estimate:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["rerun_match_estimate"], which.params())
            row = await cur.fetchone()
        if row is None:
            return Estimate(0, 0.0, 0)
        return Estimate(int(row["n"]), float(row["cost_usd"]), int(row["tokens"]),
                        int(row["calls"]))

    async def step_output(self, job_id: uuid.UUID, step: str) -> dict[str, Any] | None:
        """The job's recorded output of ``step``, or None."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["rerun_step_output"],
                                     {"id": job_id, "step": step})
            row = await cur.fetchone()
        return dict(row["output"]) if row else None

    async def rerun_since(self, job_id: uuid.UUID, since: datetime) -> bool:
        """Whether the job has a rerun created at or after ``since``."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["rerun_since"], {"id": job_id, "since": since})
            row = await cur.fetchone()
        return bool(row and row["found"])
