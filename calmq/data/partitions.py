"""The time partitions of the history tables (``job_events`` by ``at``, ``job_attempts`` by
``started_at``; migration 0032): made ahead by the housekeeping, retired whole by retention.

A job's history rows are all written at or after the job's creation, so the partition
that ends at or before the *horizon* (the oldest creation time of any job still live or
not yet past retention, never later than the retention ago) holds only the history of jobs
past retention, and goes with ``DETACH ... CONCURRENTLY`` and ``DROP TABLE``: no row is
deleted or vacuumed one by one. A partition past the retention that the horizon holds back
(one tenant's job created in it is still open, or ended lately) is not left whole for
everybody: the rows of its jobs past retention are deleted (``expire``), and only the open
jobs' rows wait for the partition to go. docs/explanation/database-at-scale.md tells the
whole story.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from psycopg import errors, sql

from calmq.data.database import Database

__all__ = ["HistoryPartitions", "Partition"]


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of job_events or job_attempts."""

    parent: str
    name: str
    lower: datetime | None  # None: from MINVALUE (the table as it was before migration 0032)
    upper: datetime
    detach_pending: bool  # a DETACH ... CONCURRENTLY of it was interrupted half way
    bytes: int
    rows_estimate: int


class HistoryPartitions:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def make_ahead(self, width_hours: float, ahead: int) -> int:
        """Make the partitions that end within ``ahead`` widths of now (each ``width_hours``
        wide) after the newest there is; returns how many were made. 0 when another process
        is making them or a long transaction holds a history table past the lock timeout
        (history_lock_timeout)."""
        width = width_hours * 3600.0
        async with self._db.pool.connection() as conn:
            try:
                async with conn.transaction():
                    await conn.execute(self._db.q["history_lock_timeout"])
                    cur = await conn.execute(self._db.q["history_partitions_make"],
                                             {"ahead_seconds": width * ahead,
                                              "width_seconds": width})
                    row = await cur.fetchone()
            except errors.LockNotAvailable:
                return 0
        return int(row["made"]) if row is not None else 0

    async def listing(self) -> list[Partition]:
        """Every partition of both tables, oldest first within each."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["history_partitions"])
            rows = await cur.fetchall()
        return [Partition(r["parent"], r["name"], r["lower"], r["upper"],
                          bool(r["detach_pending"]), int(r["bytes"]), int(r["rows_estimate"]))
                for r in rows]

    async def horizon(self, retention_seconds: float) -> datetime:
        """The time before which every history row belongs to a job past retention."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["history_horizon"],
                                     {"retention_seconds": retention_seconds})
            row = await cur.fetchone()
        # LEAST ignores NULLs, and now() - retention is never NULL.
        assert row is not None
        horizon: datetime = row["horizon"]
        return horizon

    async def retire(self, retention_seconds: float) -> list[Partition]:
        """Detach and drop every partition that ends at or before the horizon; returns them.
        A partition left detach-pending by an interrupted pass is finished first."""
        horizon = await self.horizon(retention_seconds)
        gone: list[Partition] = []
        for part in await self.listing():
            if part.upper > horizon:
                continue
            await self.drop(part)
            gone.append(part)
        return gone

    async def expire(self, retention_seconds: float, *, batch: int = 10_000,
                     seconds: float = 60.0) -> int:
        """Delete the rows of jobs past retention from the partitions past the retention that
        the horizon holds back (``retire`` leaves them), ``batch`` rows a statement, for up to
        ``seconds``; returns how many rows went. The next pass goes on where this one ended."""
        horizon = await self.horizon(retention_seconds)
        ago = datetime.now(UTC) - timedelta(seconds=retention_seconds)
        held = [p for p in await self.listing()
                if horizon < p.upper <= ago and not p.detach_pending]
        deadline = time.monotonic() + seconds
        gone = 0
        for part in held:
            statement = sql.SQL(self._db.q["history_partition_expire"]).format(
                partition=sql.Identifier(part.name))
            while time.monotonic() < deadline:
                async with self._db.pool.connection() as conn:
                    cur = await conn.execute(statement, {"limit": batch})
                gone += cur.rowcount
                if cur.rowcount < batch:
                    break
        return gone

    async def drop(self, part: Partition) -> None:
        """Detach ``part`` without blocking the table's reads and writes, then drop it."""
        names = {"parent": sql.Identifier(part.parent), "partition": sql.Identifier(part.name)}
        detach = "history_partition_finalize" if part.detach_pending else "history_partition_detach"
        async with self._db.pool.connection() as conn:
            # Autocommit (the pool's connections are): CONCURRENTLY refuses a transaction.
            await conn.execute(sql.SQL(self._db.q[detach]).format(**names))
            await conn.execute(sql.SQL(self._db.q["history_partition_drop"]).format(**names))
