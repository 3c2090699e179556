"""Provider batches of the batch lane: which job attempt is in which provider batch, and
the leases that keep one batcher packing a job and one poller collecting a batch.

A batch is recorded in two steps (docs/how-to/batch-backfills.md, "crash safety"):
``record`` writes the batch under calmq's own ``key`` and moves its jobs to the batch's
lease BEFORE the provider is asked to create it; ``submitted`` writes the provider's id and
each job's ``batched`` event once it answered. A batch left ``creating`` (its batcher died
in between) is found again at the provider by that key, or created then.

``record`` also reserves each request's estimated cost against its tenant's and the fleet's
spend caps (calmq.spending decides which fit, calmq.data.spending reads under the
reservation locks), in the same transaction: a request that does not fit is not sent, and
its job waits with the cap's reason. Each tenant's share of a batch is a ``batch_tenants``
row (migration 0049): the tenant's batch list and what its batches reserve read those.
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
from calmq.data.spending import Admit, Charge, SpendLedger

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
    reserved_usd: float = 0.0  # its estimated cost, reserved against the spend caps


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
        lease_seconds: float, hold_seconds: float, charges: Sequence[Charge] = (),
        admit: Admit | None = None, fleet_capped: bool = False,
    ) -> tuple[set[uuid.UUID], dict[uuid.UUID, str]]:
        """Record a batch about to be created (state ``creating``, leased by ``worker``) and
        move the jobs ``worker`` still holds to its lease, in ONE transaction. With
        ``admit``, the ``charges`` (each row's estimated cost, oldest first) are reserved
        against the spend caps first, under the reservation locks of their tenants (and the
        fleet's, ``fleet_capped``): the jobs of the charges it refuses are not moved but
        wait, uncounted, with the cap's reason. Returns the ids of the jobs that moved (the
        others were refused, or cancelled or taken meanwhile) and those refused (with
        their reason)."""
        async with self._db.pool.connection() as conn, conn.transaction():
            await conn.execute(self._q["batch_insert"], {
                "key": key, "provider": provider, "model": model, "endpoint": endpoint,
                "pool": pool, "request_count": len(rows), "input_bytes": input_bytes,
                "enqueued_tokens": enqueued_tokens, "worker": worker,
                "lease_seconds": lease_seconds})
            refused: dict[uuid.UUID, str] = {}
            if admit is not None and charges:
                standing = await SpendLedger(self._db).standing(
                    conn, [c.tenant_id for c in charges], fleet=fleet_capped)
                refused = dict(admit(standing, charges))
            ordered = sorted(rows, key=lambda r: r.job_id)
            await conn.execute(self._q["batch_lock_packed"],
                               {"ids": [r.job_id for r in ordered]})
            sent = [r for r in ordered if r.job_id not in refused]
            cur = await conn.execute(self._q["batch_take_jobs"], {
                "ids": [r.job_id for r in sent],
                "versions": [r.lease_version for r in sent], "worker": worker,
                "owner": batch_owner(key), "hold_seconds": hold_seconds})
            moved = {r["id"] for r in await cur.fetchall()}
            if refused:
                waiting = [r for r in ordered if r.job_id in refused]
                cur = await conn.execute(self._q["batch_hold_packed"], {
                    "ids": [r.job_id for r in waiting],
                    "versions": [r.lease_version for r in waiting],
                    "reasons": [refused[r.job_id] for r in waiting], "worker": worker})
                held = {r["id"] for r in await cur.fetchall()}
                refused = {i: reason for i, reason in refused.items() if i in held}
            await conn.execute(self._q["batch_insert_jobs"], {
                "key": key, "ids": list(moved), "rows": Jsonb([
                    {"job_id": str(r.job_id), "attempt": r.attempt, "custom_id": r.custom_id,
                     "request": r.request, "reserved_usd": r.reserved_usd} for r in rows])})
            if moved:
                await conn.execute(self._q["batch_insert_tenants"], {"key": key})
            if len(moved) != len(rows):
                await conn.execute(self._q["batch_set_count"], {"key": key,
                                                                "count": len(moved)})
        return moved, refused

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
                       limit: int = 50, after: tuple[datetime, uuid.UUID] | None = None
                       ) -> list[BatchSummary]:
        """Batches newest first. For a tenant: those holding its jobs, read from its own
        shares, the tenant's share of each, after ``after`` (the created_at and key of the
        last one of the page before); for the operator (no tenant): every batch."""
        async with self._db.pool.connection() as conn:
            if tenant_id is None:
                cur = await conn.execute(self._q["batch_list"], {"state": state,
                                                                 "limit": limit})
            else:
                cur = await conn.execute(self._q["batch_list_tenant"], {
                    "state": state, "tenant_id": tenant_id, "limit": limit,
                    "cursor_at": after[0] if after else None,
                    "cursor_key": after[1] if after else None})
            return [BatchSummary(**r) for r in await cur.fetchall()]

    async def find(self, ref: str, tenant_id: uuid.UUID | None = None) -> BatchSummary | None:
        """A batch by calmq's key or the provider's id (for a tenant: one holding its jobs,
        with the tenant's share)."""
        try:
            key: uuid.UUID | None = uuid.UUID(ref)
        except ValueError:
            key = None
        params = {"ref": ref, "key": key, "tenant_id": tenant_id}
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(
                self._q["batch_find" if tenant_id is None else "batch_find_tenant"], params)
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
