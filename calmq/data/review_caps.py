"""Review caps enforced (calmq/sql/review_caps.sql): past a pool's cap, its new jobs that can
end in review wait in ``queued`` (event ``waiting``, reason ``review_cap``) instead of piling
up pending reviews, and are re-published (event ``resumed``) as decisions free room.

Why hold in the database rather than leave the Kafka message pending: a message left
uncommitted for as long as reviewers take (hours) would block every later offset of its
partition from being committed, and a restart would redeliver all of them. A held job's
message is acknowledged; the job keeps ``queued`` (no attempt counted, never dropped) and
the release pass gives it a fresh ``job.requested`` through the outbox, like the sweeper.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from calmq.data.database import Database
from calmq.data.jobs import Job, republish

__all__ = ["ReviewCaps"]


class ReviewCaps:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._q = db.q

    async def capped_pools(self) -> dict[str, int]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["review_capped_pools"])
            return {str(r["pool"]): int(r["cap"]) for r in await cur.fetchall()}

    async def hold(self, ids: Sequence[uuid.UUID], workflows: Sequence[str]) -> set[uuid.UUID]:
        """Hold the queued jobs among ``ids`` (of the workflows that can end in review) that
        would take their pool past its cap, and mark the rest as let through (they count
        against the cap from now on); returns the ids held (their messages are done)."""
        if not ids:
            return set()
        async with self._db.pool.connection() as conn, conn.transaction():
            # The caps first, in a statement of their own: the count below then reads what
            # the holds and releases of these pools committed while this one waited (a lock
            # taken inside the counting statement leaves its count on the snapshot from
            # before the wait, and two holds both saw the last room: CI, three reviews
            # under a cap of two).
            await conn.execute(self._q["lock_review_caps"], {"ids": list(ids)})
            cur = await conn.execute(self._q["hold_for_review_cap"],
                                     {"ids": list(ids), "workflows": list(workflows)})
            return {uuid.UUID(str(r["id"])) for r in await cur.fetchall()}

    async def release(self, workflows: Sequence[str], limit: int = 500) -> list[Job]:
        """Re-publish held jobs as far as their pools' caps have room (or have no cap now);
        ``workflows``: those that can end in review (their admitted jobs use room)."""
        async with self._db.pool.connection() as conn, conn.transaction():
            await conn.execute(self._q["lock_all_review_caps"])  # as in hold
            cur = await conn.execute(self._q["release_review_cap_holds"],
                                     {"limit": limit, "workflows": list(workflows)})
            jobs = [Job.from_row(r) for r in await cur.fetchall()]
            await republish(conn, self._q["insert_outbox"], jobs)
        return jobs

    async def held(self) -> dict[str, int]:
        """How many jobs wait for each pool's cap."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["review_cap_held"])
            return {str(r["pool"]): int(r["held"]) for r in await cur.fetchall()}
