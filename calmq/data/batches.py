"""Provider batches of the batch lane: which job attempt is in which provider batch, and
the leases that keep one batcher packing a job and one poller collecting a batch.

A batch is recorded in two steps (docs/how-to/batch-backfills.md, "crash safety"):
``record`` writes the batch under calmq's own ``key`` and moves its jobs to the batch's
lease BEFORE the provider is asked to create it; ``submitted`` writes the provider's id and
each job's ``batched`` event once it answered. A batch left ``creating`` (its batcher died
in between) is found again at the provider by that key, or created then.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from calmq.data.database import Database
from calmq.data.jobs import Job, republish

__all__ = ["BatchMember", "BatchRequestRow", "BatchSummary", "Batches", "OpenBatch",
           "batch_owner"]


def batch_owner(key: uuid.UUID) -> str:
    """The lease owner of a batch's jobs while the batch holds them."""
    return f"batch:{key}"


@dataclass(frozen=True, slots=True)
class BatchRequestRow:
    """One request of a batch being recorded: the job attempt and the exact request body."""

    job_id: uuid.UUID
    attempt: int
    custom_id: str
    request: dict[str, Any]
    lease_version: int = 0  # the packing attempt's fencing token


@dataclass(frozen=True, slots=True)
class OpenBatch:
    """A batch a poller has taken (``batch_claim_due``)."""

    key: uuid.UUID
    provider: str
    model: str
    endpoint: str
    pool: str
    provider_id: str | None
    state: str
    request_count: int
    created_at: datetime
    cancel_requested: bool

    @property
    def ended(self) -> bool:
        """Collected (or abandoned): what is left is to delete its files at the provider."""
        return self.state in ("collected", "abandoned")


@dataclass(frozen=True, slots=True)
class BatchSummary:
    key: uuid.UUID
    provider: str
    model: str
    pool: str
    provider_id: str | None
    state: str
    provider_status: str | None
    request_count: int
    created_at: datetime
    submitted_at: datetime | None
    ended_at: datetime | None
    collected_at: datetime | None
    counts: dict[str, Any]
    cancel_requested: bool
    cost_usd: float
    online_cost_usd: float
    # Requests of other tenants in the batch, when read for one tenant (0 unscoped): the
    # counts and costs above are then that tenant's share; this is not shown, only used to
    # refuse a tenant's cancel of a shared batch.
    others: int = 0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:
            if name == "others":
                continue
            value = getattr(self, name)
            out[name] = (value.isoformat() if isinstance(value, datetime)
                         else str(value) if isinstance(value, uuid.UUID) else value)
        out["savings_usd"] = round(self.online_cost_usd - self.cost_usd, 9)
        return out


@dataclass(frozen=True, slots=True)
class BatchMember:
    job_id: uuid.UUID
    attempt: int
    custom_id: str
    state: str
    status: str
    input_tokens: int
    output_tokens: int
    cost_usd: float
    online_cost_usd: float
    settled_at: datetime | None

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": str(self.job_id), "attempt": self.attempt, "custom_id": self.custom_id,
                "state": self.state, "status": self.status, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "cost_usd": self.cost_usd,
                "online_cost_usd": self.online_cost_usd,
                "settled_at": self.settled_at.isoformat() if self.settled_at else None}


class Batches:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._q = db.q

    async def record(
        self, *, key: uuid.UUID, provider: str, model: str, endpoint: str, pool: str,
        worker: str, rows: Sequence[BatchRequestRow], input_bytes: int, enqueued_tokens: int,
        lease_seconds: float, hold_seconds: float,
    ) -> set[uuid.UUID]:
        """Record a batch about to be created (state ``creating``, leased by ``worker``) and
        move the jobs ``worker`` still holds to its lease, in ONE transaction; returns the
        ids of the jobs that moved (the others were cancelled or taken meanwhile)."""
        async with self._db.pool.connection() as conn, conn.transaction():
            await conn.execute(self._q["batch_insert"], {
                "key": key, "provider": provider, "model": model, "endpoint": endpoint,
                "pool": pool, "request_count": len(rows), "input_bytes": input_bytes,
                "enqueued_tokens": enqueued_tokens, "worker": worker,
                "lease_seconds": lease_seconds})
            ordered = sorted(rows, key=lambda r: r.job_id)
            cur = await conn.execute(self._q["batch_take_jobs"], {
                "ids": [r.job_id for r in ordered],
                "versions": [r.lease_version for r in ordered], "worker": worker,
                "owner": batch_owner(key), "hold_seconds": hold_seconds})
            moved = {r["id"] for r in await cur.fetchall()}
            await conn.execute(self._q["batch_insert_jobs"], {
                "key": key, "ids": list(moved), "rows": Jsonb([
                    {"job_id": str(r.job_id), "attempt": r.attempt, "custom_id": r.custom_id,
                     "request": r.request} for r in rows])})
            if len(moved) != len(rows):
                await conn.execute(self._q["batch_set_count"], {"key": key,
                                                                "count": len(moved)})
        return moved

    async def submitted(self, key: uuid.UUID, provider_id: str, status: str,
                        poll_seconds: float) -> None:
        """The provider has the batch: its id, and each job's ``batched`` event."""
        async with self._db.pool.connection() as conn:
            await conn.execute(self._q["batch_submitted"], {
                "key": key, "provider_id": provider_id, "status": status,
                "poll_seconds": poll_seconds})

    async def claim_due(self, worker: str, lease_seconds: float, limit: int = 8,
                        pool: str | None = None) -> list[OpenBatch]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_claim_due"], {
                "worker": worker, "lease_seconds": lease_seconds, "limit": limit,
                "pool": pool})
            return [OpenBatch(**r) for r in await cur.fetchall()]

    async def heartbeat(self, key: uuid.UUID, worker: str, lease_seconds: float) -> bool:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_heartbeat"], {
                "key": key, "worker": worker, "lease_seconds": lease_seconds})
            return await cur.fetchone() is not None

    async def release(self, key: uuid.UUID, worker: str, *, status: str | None,
                      counts: dict[str, Any], poll_seconds: float) -> None:
        async with self._db.pool.connection() as conn:
            await conn.execute(self._q["batch_release"], {
                "key": key, "worker": worker, "status": status, "counts": Jsonb(counts),
                "poll_seconds": poll_seconds})

    async def later(self, key: uuid.UUID, worker: str, seconds: float) -> None:
        """Let go of a batch until its next look, ``seconds`` from now (a refused call)."""
        async with self._db.pool.connection() as conn:
            await conn.execute(self._q["batch_later"], {"key": key, "worker": worker,
                                                        "seconds": seconds})

    async def requests(self, key: uuid.UUID) -> list[tuple[str, dict[str, Any]]]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_requests"], {"key": key})
            return [(r["custom_id"], r["request"]) for r in await cur.fetchall()]

    async def known_ids(self, provider: str) -> set[str]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_known_ids"], {"provider": provider})
            return {r["provider_id"] for r in await cur.fetchall()}

    async def pending_jobs(self, key: uuid.UUID, custom_ids: Sequence[str] | None,
                           limit: int = 10_000) -> dict[str, Job]:
        """The jobs still waiting for these results (custom_id -> Job), held by the batch."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_pending_jobs"], {
                "key": key, "owner": batch_owner(key), "limit": limit,
                "custom_ids": list(custom_ids) if custom_ids is not None else None})
            rows = await cur.fetchall()
        out: dict[str, Job] = {}
        for row in rows:
            custom_id = row.pop("custom_id")
            out[custom_id] = Job.from_row(row)
        return out

    async def settle(self, key: uuid.UUID, rows: Sequence[dict[str, Any]]) -> None:
        """Mark requests settled (or retried) with their tokens and both costs."""
        if not rows:
            return
        async with self._db.pool.connection() as conn:
            await conn.execute(self._q["batch_settle"], {"key": key, "rows": Jsonb(list(rows))})

    async def fall_back_online(self, ids: Sequence[uuid.UUID]) -> None:
        if not ids:
            return
        async with self._db.pool.connection() as conn:
            await conn.execute(self._q["batch_fall_back_online"], {"ids": list(ids)})

    async def collected(self, key: uuid.UUID, status: str | None,
                        counts: dict[str, Any]) -> None:
        async with self._db.pool.connection() as conn, conn.transaction():
            await conn.execute(self._q["batch_collected"], {
                "key": key, "status": status, "counts": Jsonb(counts)})

    async def hand_back(self, key: uuid.UUID, ids: Sequence[uuid.UUID] | None, *,
                        waiting_reason: str | None, detail: dict[str, Any],
                        republish_jobs: bool) -> list[Job]:
        """Give jobs of the batch back with no attempt counted (``ids`` None: every job it
        still holds): to wait for their provider (``waiting_reason`` provider_blocked), or
        re-published at once for another batch (``republish_jobs``), in ONE transaction."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q["batch_hand_back"], {
                "key": key, "owner": batch_owner(key),
                "ids": sorted(ids) if ids is not None else None,
                "waiting_reason": waiting_reason, "detail": Jsonb(detail)})
            jobs = [Job.from_row(r) for r in await cur.fetchall()]
            if republish_jobs:
                await republish(conn, self._q["insert_outbox"], jobs)
        return jobs

    async def abandon(self, key: uuid.UUID) -> None:
        """A batch the provider never created: nothing to collect."""
        async with self._db.pool.connection() as conn:
            await conn.execute(self._q["batch_abandon"], {"key": key})

    async def files_deleted(self, key: uuid.UUID) -> None:
        """The provider holds nothing of the batch any more."""
        async with self._db.pool.connection() as conn:
            await conn.execute(self._q["batch_files_deleted"], {"key": key})

    async def enqueued_tokens(self, provider: str, model: str) -> int:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_enqueued_tokens"],
                                     {"provider": provider, "model": model})
            row = await cur.fetchone()
            return int(row["tokens"]) if row else 0

    async def overview(self, *, state: str | None = None, tenant_id: uuid.UUID | None = None,
                   limit: int = 50) -> list[BatchSummary]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_list"], {
                "state": state, "tenant_id": tenant_id, "limit": limit})
            return [BatchSummary(**r) for r in await cur.fetchall()]

    async def find(self, ref: str, tenant_id: uuid.UUID | None = None) -> BatchSummary | None:
        """A batch by calmq's key or the provider's id (for a tenant: one holding its jobs)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_find"], {"ref": ref,
                                                             "tenant_id": tenant_id})
            row = await cur.fetchone()
            return BatchSummary(**row) if row else None

    async def members(self, key: uuid.UUID, tenant_id: uuid.UUID | None = None,
                      limit: int = 1000) -> list[BatchMember]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_members"], {
                "key": key, "tenant_id": tenant_id, "limit": limit})
            return [BatchMember(**r) for r in await cur.fetchall()]

    async def request_cancel(self, key: uuid.UUID) -> bool:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_request_cancel"], {"key": key})
            return await cur.fetchone() is not None

    async def stats(self) -> dict[str, Any]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["batch_stats"])
            row = await cur.fetchone()
            return dict(row) if row else {}
