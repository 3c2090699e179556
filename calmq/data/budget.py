"""The token budget's ledger: the fleet's shared buckets (table budget_buckets), and the
tokens and cost each model call adds to its job and attempt.

The bucket arithmetic runs inside PostgreSQL (migration 0005's functions), so every
change is one statement; how a process leases and spends slices is calmq.calls.budget's.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Protocol

from calmq.data.database import Database

__all__ = ["BucketLimits", "BucketState", "BudgetLedger", "Grant", "TenantTokenLedger",
           "Usage", "UsageLedger"]


class BucketLimits(Protocol):
    """What a bucket row is configured from (calmq.calls.budget.BucketLimits is one): the data
    layer reads these numbers and imports nothing above it."""

    @property
    def tokens_per_minute(self) -> int: ...
    @property
    def requests_per_minute(self) -> int: ...
    @property
    def token_rate(self) -> float: ...
    @property
    def request_rate(self) -> float: ...
    @property
    def token_cap(self) -> float: ...
    @property
    def request_cap(self) -> float: ...
    @property
    def interactive_share(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Grant:
    """A slice of budget from the ledger; nothing granted means wait ``wait_seconds``."""

    tokens: float
    requests: float
    wait_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class BucketState:
    """One provider and model's buckets as stored (for tooling and tests)."""

    provider: str
    model: str
    tokens_per_minute: int
    requests_per_minute: int
    token_rate: float
    request_rate: float
    token_cap: float
    request_cap: float
    interactive_share: float
    bulk_tokens: float
    bulk_requests: float
    interactive_tokens: float
    interactive_requests: float
    refilled_at: datetime
    paused_until: datetime | None  # None: never paused


@dataclass(frozen=True, slots=True)
class Usage:
    """Model calls' tokens and cost, to add to a job and its current attempt."""

    job_id: uuid.UUID
    input_tokens: int
    output_tokens: int
    cost_usd: float
    model_calls: int
    # Of the input: read from and written to the provider's prompt cache, and what the
    # cache saved (calmq.calls.caching).
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    cache_saved_usd: float = 0.0


class BudgetLedger:
    """The buckets as rows of ``budget_buckets``; a ``calmq.calls.budget.SharedBuckets``."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def _run(self, name: str, params: dict[str, Any]) -> dict[str, Any] | None:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q[name], params)
            if cur.description is None:
                return None
            return await cur.fetchone()

    async def configure(self, provider: str, model: str, limits: BucketLimits) -> None:
        await self._run("budget_configure", {
            "provider": provider, "model": model,
            "tokens_per_minute": limits.tokens_per_minute,
            "requests_per_minute": limits.requests_per_minute,
            "token_rate": limits.token_rate, "request_rate": limits.request_rate,
            "token_cap": limits.token_cap, "request_cap": limits.request_cap,
            "interactive_share": limits.interactive_share,
        })

    async def take(
        self, provider: str, model: str, priority: str, *, need_tokens: float,
        want_tokens: float, want_requests: float,
    ) -> Grant:
        row = await self._run("budget_take", {
            "provider": provider, "model": model, "priority": priority,
            "need_tokens": need_tokens, "want_tokens": want_tokens,
            "want_requests": want_requests,
        })
        assert row is not None
        if not row["known"]:  # someone deleted the row: configure() again on the next start
            return Grant(want_tokens, want_requests)
        return Grant(row["granted_tokens"], row["granted_requests"], row["wait_seconds"])

    async def give_back(
        self, provider: str, model: str, priority: str, tokens: float, requests: float
    ) -> None:
        await self._run("budget_give_back", {
            "provider": provider, "model": model, "priority": priority,
            "tokens": tokens, "requests": requests,
        })

    async def pause(self, provider: str, model: str, seconds: float) -> None:
        await self._run("budget_pause", {"provider": provider, "model": model,
                                         "seconds": seconds})

    async def bucket(self, provider: str, model: str) -> BucketState | None:
        row = await self._run("budget_bucket", {"provider": provider, "model": model})
        return BucketState(**row) if row is not None else None


class UsageLedger:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def add(self, usages: Sequence[Usage]) -> None:
        """Add each usage to its job and attempt, in one transaction. One job's rows in id
        order, so two concurrent writers never lock two jobs in opposite orders."""
        rows = [asdict(u) for u in sorted(usages, key=lambda u: u.job_id)]
        async with self._db.pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            await cur.executemany(self._db.q["budget_record_usage"], rows)


class TenantTokenLedger:
    """Each tenant's token quota as a row of ``tenant_token_buckets`` (migration 0012)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def take(self, tenant_id: uuid.UUID, need: float, rate: float, cap: float, *,
                   debt: float = 0.0) -> tuple[bool, float]:
        """(granted, seconds to wait when not); ``debt``: how many tokens below empty the
        call may take the quota (an interactive call's bound), counted all the same."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["tenant_tokens_take"], {
                "tenant_id": tenant_id, "need": need, "rate": rate, "cap": cap,
                "debt": float(debt)})
            row = await cur.fetchone()
        assert row is not None
        return bool(row["granted"]), float(row["wait_seconds"])

    async def give_back(self, tenant_id: uuid.UUID, tokens: float, cap: float) -> None:
        async with self._db.pool.connection() as conn:
            await conn.execute(self._db.q["tenant_tokens_give_back"], {
                "tenant_id": tenant_id, "tokens": tokens, "cap": cap})

    async def quotas(self) -> dict[uuid.UUID, int]:
        """Tenants with a tokens-per-minute quota of their own."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["tenant_token_quotas"])
            return {r["id"]: int(r["tokens_per_minute"]) for r in await cur.fetchall()}

    async def active_tenants(self) -> int:
        """Tenants whose calls took from their quota in the last minute."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["tenant_tokens_active"])
            row = await cur.fetchone()
        return int(row["active"]) if row is not None else 0

    async def level(self, tenant_id: uuid.UUID) -> float | None:
        """The tokens the tenant's bucket held at its last touch (tooling and tests)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["tenant_token_level"], {"tenant_id": tenant_id})
            row = await cur.fetchone()
        return float(row["tokens"]) if row is not None else None
