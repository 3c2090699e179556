"""Holds whose rule is their statement alone (calmq.holds): a gate's statement that decides
and holds (``Hold.gate``), and a release pass with no code of its own in
processors/releases.py (the statement lets jobs go and this re-publishes them)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from calmq.data.database import Database
from calmq.data.jobs import Job, republish

__all__ = ["HeldJobs"]


class HeldJobs:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._q = db.q

    async def hold(self, statement: str, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """Run a gate's hold ``statement`` on the jobs ``ids`` (a calmq/sql query taking
        ``ids`` and returning the ids of those it held); returns them."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q[statement], {"ids": list(ids)})
            return {uuid.UUID(str(r["id"])) for r in await cur.fetchall()}

    async def release(self, statement: str, limit: int = 500) -> list[Job]:
        """Run the release ``statement`` (a calmq/sql query taking ``limit`` and returning
        the job rows it let go) and re-publish those jobs in its transaction."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q[statement], {"limit": limit})
            jobs = [Job.from_row(r) for r in await cur.fetchall()]
            await republish(conn, self._q["insert_outbox"], jobs)
        return jobs
