"""Rate limits per concurrency key as rows (calmq/sql/rate_keys.sql, migration 0047): one
token bucket of requests and tokens per tenant, key and workflow, shared by the fleet.
What a call reserves and when it waits is calmq.calls.key_rates'."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from calmq.data.database import Database

__all__ = ["RateKeys", "Reservation"]


@dataclass(frozen=True)
class Reservation:
    taken: bool
    requests_left: float  # after the reservation (or before it, when it did not fit)
    tokens_left: float


class RateKeys:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._q = db.q

    async def reserve(self, tenant_id: uuid.UUID | str, key: str, scope: str, *,
                      requests: int, tokens: int, requests_cap: int, tokens_cap: int,
                      per_seconds: float) -> Reservation:
        """Take ``requests`` and ``tokens`` from the key's bucket if both fit (a cap of 0
        counts nothing of that kind)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["key_rate_reserve"], {
                "tenant_id": tenant_id, "key": key, "scope": scope, "requests": requests,
                "tokens": tokens, "requests_cap": requests_cap, "tokens_cap": tokens_cap,
                "per_seconds": per_seconds})
            row = await cur.fetchone()
        assert row is not None
        return Reservation(bool(row["last_taken"]), float(row["requests"]),
                           float(row["tokens"]))

    async def settle(self, tenant_id: uuid.UUID | str, key: str, scope: str, *,
                     refund: float, tokens_cap: int) -> None:
        """Give back what a call reserved and did not use (negative: it used more)."""
        async with self._db.pool.connection() as conn:
            await conn.execute(self._q["key_rate_settle"], {
                "tenant_id": tenant_id, "key": key, "scope": scope, "refund": refund,
                "tokens_cap": tokens_cap})

    async def waiting(self, tenant_id: uuid.UUID | str, key: str) -> int:
        """How many of the key's jobs wait for its rate limit now."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["key_rate_waiting"],
                                     {"tenant_id": tenant_id, "key": key})
            row = await cur.fetchone()
        return int(row["n"]) if row is not None else 0

    async def retire_idle(self) -> int:
        """Drop the buckets idle for a day (full again); returns how many."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["key_rate_retire"])
            return cur.rowcount
