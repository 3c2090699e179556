"""Deleting tenant data: redacting a terminal job's row and history, and what is past its
retention (old terminal jobs, old idempotency keys). The order of work (objects first, then
the row) is calmq.producers.retention's."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from calmq.data.database import Database

__all__ = ["JobData", "Retention"]


@dataclass(frozen=True, slots=True)
class JobData:
    """What a purge needs to know of a job: whether it may go, and the objects it names."""

    status: str
    input_ref: str | None
    artifact: dict[str, Any] | None
    redacted_at: datetime | None


class Retention:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def job_data(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> JobData | None:
        """The tenant's job as a purge sees it; None for another tenant's or no job."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["job_status"],
                                     {"id": job_id, "tenant_id": tenant_id})
            row = await cur.fetchone()
        if row is None:
            return None
        return JobData(row["status"], row["input_ref"], row["artifact"], row["redacted_at"])

    async def redact(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> None:
        """Drop a terminal job's data and its history's details, keeping status and shape."""
        async with self._db.pool.connection() as conn, conn.transaction():
            await conn.execute(self._db.q["retention_redact_job"],
                               {"id": job_id, "tenant_id": tenant_id})
            await conn.execute(self._db.q["retention_redact_events"], {"id": job_id})

    async def prune_idempotency_keys(self, retention_seconds: float) -> int:
        """Delete idempotency keys older than the retention; returns how many."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["retention_prune_idempotency_keys"],
                                     {"retention_seconds": retention_seconds})
            return cur.rowcount

    async def expired_jobs(
        self, retention_seconds: float, limit: int
    ) -> list[tuple[uuid.UUID, uuid.UUID]]:
        """``(tenant_id, job_id)`` of terminal jobs past retention that still hold data."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["retention_expired_jobs"],
                                     {"retention_seconds": retention_seconds, "limit": limit})
            rows = await cur.fetchall()
        return [(r["tenant_id"], r["id"]) for r in rows]
