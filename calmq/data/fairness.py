"""The waiting room of a contended queue, as rows (calmq/sql/fairness.sql, migration 0044).

A job in it is ``queued`` (or ``retrying``) with ``waiting_reason`` ``fair_share``: no
attempt counted, its message acknowledged. Workers take jobs out of it into their free
slots, the tenant furthest below its weighted share of the queue's running jobs first
(``pick``); when a job waits is calmq.processors.admission's (``FairShareGate``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from calmq.data.database import Database
from calmq.data.jobs import Job, republish

__all__ = ["FairQueue", "Pick", "Picked"]


@dataclass(frozen=True, slots=True)
class Picked:
    """A job taken out of a waiting room, for its worker to admit and claim."""

    id: uuid.UUID
    step: str
    workflow: str
    tenant_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class Pick:
    """What one pick took, fairest first, and whether the room still holds jobs of the
    queue that it left (the headroom kept them, or another worker's pick had them)."""

    jobs: list[Picked]
    more: bool


class FairQueue:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._q = db.q

    async def hold(self, ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
        """Put the waiting ones of ``ids`` in their queue's waiting room; returns those held
        (the others are running, finished or gone: their messages go on to the claim)."""
        if not ids:
            return set()
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["fair_share_hold"], {"ids": list(ids)})
            return {uuid.UUID(str(r["id"])) for r in await cur.fetchall()}

    async def waiting(self, pool: str, priority: str) -> bool:
        """Whether the queue's waiting room holds any job."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["fair_share_waiting"],
                                     {"pool": pool, "priority": priority})
            row = await cur.fetchone()
        return bool(row and row["waiting"])

    async def pick(self, pool: str, priority: str, limit: int, headroom: int = 0) -> Pick:
        """Take up to ``limit`` jobs out of the queue's waiting room, fairest first, for the
        caller to claim in that order. The last ``headroom`` of the ``limit`` go only to a
        tenant within its weighted share of the queue (calmq/sql/fairness.sql)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["fair_share_pick"],
                                     {"pool": pool, "priority": priority, "limit": limit,
                                      "headroom": headroom})
            rows = await cur.fetchall()
        return Pick([Picked(r["id"], str(r["step"]), str(r["workflow"]), r["tenant_id"])
                     for r in rows if r["id"] is not None],
                    more=any(r["id"] is None for r in rows))

    async def release_stale(self, grace_seconds: float, limit: int = 500) -> list[Job]:
        """Re-publish the jobs that waited in a waiting room for ``grace_seconds`` with no
        worker holding them again or picking them."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q["fair_share_release_stale"],
                                     {"grace_seconds": grace_seconds, "limit": limit})
            jobs = [Job.from_row(r) for r in await cur.fetchall()]
            await republish(conn, self._q["insert_outbox"], jobs)
        return jobs

    async def return_picked(self, grace_seconds: float, limit: int = 500) -> int:
        """Put back into their rooms the jobs picked ``grace_seconds`` ago or more and never
        claimed (their worker died between the pick and the claim); returns how many."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["fair_share_return_picked"],
                                     {"grace_seconds": grace_seconds, "limit": limit})
            return len(await cur.fetchall())

    async def set_weight(self, name: str, weight: float) -> bool:
        """A tenant's weight in every queue's fair share; False: no tenant of that name."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["set_tenant_weight"],
                                     {"name": name, "weight": weight})
            return await cur.fetchone() is not None
