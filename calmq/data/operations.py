"""What the on-call commands read from PostgreSQL: jobs in flight per work topic, the budget's
buckets as of now, and the tokens each tenant and priority used within a window.

Read-only: nothing here writes, so a person may run them against a live fleet at any time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import dict_row

from calmq import sql
from calmq.data.database import Database

__all__ = ["BucketNow", "InFlight", "Operations", "TenantUse", "probe"]


@dataclass(frozen=True, slots=True)
class InFlight:
    """Jobs of one pool and priority (one work topic) held by a worker, or waiting for one."""

    pool: str
    priority: str
    in_flight: int
    waiting: int


@dataclass(frozen=True, slots=True)
class BucketNow:
    """One provider and model's buckets, the levels refilled up to the moment of reading.

    A negative level is a debt: calls granted more than the bucket held (a prompt larger
    than the bucket, or a call that cost more than it reserved). It is paid off by the refill
    before that priority is granted anything again.
    """

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
    paused_until: datetime | None  # None: not paused now
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class TenantUse:
    """Tokens and model calls of a tenant's attempts at one priority within a window."""

    tenant: str
    priority: str
    attempts: int
    model_calls: int
    input_tokens: int
    output_tokens: int


class Operations:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def in_flight(self) -> list[InFlight]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["ops_jobs_in_flight"])
            rows = await cur.fetchall()
        return [InFlight(str(r["pool"]), str(r["priority"]), int(r["in_flight"]),
                         int(r["waiting"])) for r in rows]

    async def buckets(self) -> list[BucketNow]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["ops_budget_buckets"])
            rows = await cur.fetchall()
        return [BucketNow(**r) for r in rows]

    async def usage(self, window_seconds: float) -> list[TenantUse]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["ops_budget_usage"],
                                     {"window_seconds": window_seconds})
            rows = await cur.fetchall()
        return [TenantUse(**r) for r in rows]


def probe(database_url: str, timeout_seconds: float) -> tuple[str, int | None]:
    """One connection, within ``timeout_seconds``: the server's version and calmq's schema
    version (None: not migrated). Raises psycopg.Error when the database does not answer."""
    ms = int(timeout_seconds * 1000)
    with psycopg.connect(database_url, connect_timeout=max(1, int(timeout_seconds)),
                         autocommit=True, row_factory=dict_row,
                         options=f"-c statement_timeout={ms}") as conn:
        try:
            row = conn.execute(sql.queries()["ops_health"]).fetchone()
        except psycopg.errors.UndefinedTable:
            row = {"server_version": conn.info.parameter_status("server_version"),
                   "schema_version": None}
    assert row is not None
    version = row["schema_version"]
    return str(row["server_version"]), int(version) if version is not None else None
