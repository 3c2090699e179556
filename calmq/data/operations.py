"""What the on-call commands read from PostgreSQL: jobs in flight per work topic, the budget's
buckets as of now, the tokens each tenant and priority used within a window, and the cost
per job and per accepted job of each workflow and tenant.

Read-only: nothing here writes, so a person may run them against a live fleet at any time.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import dict_row

from calmq import sql
from calmq.data.database import Database

__all__ = ["BucketNow", "InFlight", "JobCosts", "Operations", "TenantUse", "probe"]


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


@dataclass(frozen=True, slots=True)
class JobCosts:
    """What the jobs of one workflow and tenant that ended within a window cost (ops_job_costs):
    every job (completed or dead-lettered) and the accepted ones (completed), each job's every
    attempt included; and of their input, what the prompt cache served and saved."""

    workflow: str
    tenant: str
    jobs: int
    cost_usd: float
    accepted: int
    accepted_cost_usd: float
    input_tokens: int
    cached_input_tokens: int
    cache_write_tokens: int
    cache_saved_usd: float

    @property
    def cost_per_job(self) -> float | None:
        return self.cost_usd / self.jobs if self.jobs else None

    @property
    def cost_per_accepted_job(self) -> float | None:
        """What one accepted job cost (None: none was accepted)."""
        return self.accepted_cost_usd / self.accepted if self.accepted else None

    @property
    def cached_share(self) -> float | None:
        """Of the input tokens, the share read from the prompt cache (None: no input)."""
        return self.cached_input_tokens / self.input_tokens if self.input_tokens else None

    def as_dict(self) -> dict[str, object]:
        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 9)

        return {"workflow": self.workflow, "tenant": self.tenant, "jobs": self.jobs,
                "cost_usd": rounded(self.cost_usd), "cost_per_job_usd":
                rounded(self.cost_per_job), "accepted": self.accepted,
                "accepted_cost_usd": rounded(self.accepted_cost_usd),
                "cost_per_accepted_job_usd": rounded(self.cost_per_accepted_job),
                "input_tokens": self.input_tokens,
                "cached_input_tokens": self.cached_input_tokens,
                "cache_write_tokens": self.cache_write_tokens,
                "cached_share": None if self.cached_share is None
                else round(self.cached_share, 4),
                "cache_saved_usd": rounded(self.cache_saved_usd)}


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

    async def costs(self, window_seconds: float, *, tenant_id: uuid.UUID | None = None,
                    tenant: str | None = None, workflow: str | None = None) -> list[JobCosts]:
        """Cost per job and per accepted job of each workflow and tenant whose jobs ended
        within the window (``tenant_id``/``tenant``/``workflow``: only those; None: all)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["ops_job_costs"], {
                "window_seconds": window_seconds, "tenant_id": tenant_id, "tenant": tenant,
                "workflow": workflow})
            rows = await cur.fetchall()
        return [JobCosts(**r) for r in rows]


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
