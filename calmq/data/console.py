"""What the web console reads (calmq/sql/console.sql): jobs with filters, the review queue,
the overview's backlog, outcomes, spend and budget, and the per-pool review caps.

Every read takes ``tenant_id``: a tenant key's console sees only that tenant; None (a
platform key) sees every tenant. The overview reads the tables the Prometheus samplers and
counters are fed from (jobs, job_events, job_attempts, budget_buckets), so the page and
/metrics agree.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from calmq.data.database import Database

__all__ = ["ConsoleJob", "ConsoleReads", "JobQuery", "Overview", "QueuedReview"]


@dataclass(frozen=True, slots=True)
class JobQuery:
    """The jobs list's filters (None: any)."""

    tenant_id: uuid.UUID | None
    statuses: list[str] | None = None
    workflow: str | None = None
    pool: str | None = None
    priority: str | None = None  # interactive, bulk
    lane: str | None = None  # online, batch
    created_after: datetime | None = None
    created_before: datetime | None = None
    search: str | None = None  # a job id or its first characters, or a metadata value
    limit: int = 100


@dataclass(frozen=True, slots=True)
class ConsoleJob:
    id: uuid.UUID
    tenant: str
    workflow: str
    status: str
    priority: str
    lane: str
    pool: str
    step: str
    attempt: int
    created_at: datetime
    updated_at: datetime
    metadata: dict[str, Any]


@dataclass(frozen=True, slots=True)
class QueuedReview:
    id: uuid.UUID
    tenant: str
    tenant_id: uuid.UUID
    workflow: str
    step: str
    pool: str
    review_deadline_at: datetime | None
    updated_at: datetime
    created_at: datetime
    input: Any
    input_ref: str | None
    output: dict[str, Any]
    confidence: float | None


@dataclass(frozen=True, slots=True)
class Overview:
    backlog: list[dict[str, Any]]  # {pool, priority, lane, status, jobs, oldest_seconds}
    outcomes: list[dict[str, Any]]  # {bin, type, jobs}
    spend: list[dict[str, Any]]  # {hour, tokens, cost_usd, retry_cost_usd, dead_letter_cost_usd}
    budget: list[dict[str, Any]]  # {provider, model, tokens_per_minute}
    review_caps: dict[str, int]
    # Jobs waiting in queued for their pool's review cap (calmq.data.review_caps), per pool.
    review_cap_held: dict[str, int] | None = None


class ConsoleReads:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def _rows(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q[name], params)
            return list(await cur.fetchall())

    async def jobs(self, query: JobQuery) -> list[ConsoleJob]:
        params = {f: getattr(query, f) for f in JobQuery.__dataclass_fields__}
        return [ConsoleJob(**r) for r in await self._rows("console_jobs", params)]

    async def reviews(self, tenant_id: uuid.UUID | None, limit: int = 100) -> list[QueuedReview]:
        rows = await self._rows("console_reviews", {"tenant_id": tenant_id, "limit": limit})
        return [QueuedReview(**r) for r in rows]

    async def overview(self, tenant_id: uuid.UUID | None) -> Overview:
        scope = {"tenant_id": tenant_id}
        caps = await self._rows("console_review_caps", {})
        return Overview(
            backlog=await self._rows("console_backlog", scope),
            outcomes=await self._rows("console_outcomes", scope),
            spend=await self._rows("console_spend", scope),
            budget=await self._rows("console_budget", {}),
            review_caps={str(r["pool"]): int(r["cap"]) for r in caps},
            review_cap_held={str(r["pool"]): int(r["held"])
                             for r in await self._rows("review_cap_held", {})},
        )

    async def set_review_cap(self, pool: str, cap: int | None, by: str) -> None:
        """Set (or with None remove) the number of pending reviews a pool's reviewers handle."""
        async with self._db.pool.connection() as conn:
            await conn.execute(self._db.q["console_set_review_cap"],
                               {"pool": pool, "cap": cap, "by": by})

    async def last_event_id(self, job_id: uuid.UUID) -> int:
        rows = await self._rows("console_last_event", {"id": job_id})
        return int(rows[0]["id"]) if rows else 0
