"""Concurrency keys as rows (calmq/sql/concurrency.sql, migration 0045): a job's
``concurrency_key`` (a customer inside its tenant, given at submit), and the jobs that wait
for their key's room (``waiting_reason`` ``concurrency_key``). The limit per key is the
workflow's ``concurrency_limit``; what waits when is calmq.processors.admission's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence

from calmq.data.database import Database
from calmq.data.jobs import Job, republish

__all__ = ["ConcurrencyKeys"]


class ConcurrencyKeys:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._q = db.q

    async def admit(self, ids: Sequence[uuid.UUID], limits: Mapping[str, int],
                    admitted_seconds: float) -> set[uuid.UUID]:
        """Admit the jobs of ``ids`` that fit under their keys' limits (``limits``: per
        workflow) and hold the rest; returns those held. The keys are locked first, in the
        same transaction, so that admissions of one key across the fleet take turns."""
        if not ids or not limits:
            return set()
        params = {"ids": list(ids), "limits": json.dumps(dict(limits)),
                  "admitted_seconds": admitted_seconds}
        async with self._db.pool.connection() as conn, conn.transaction():
            await conn.execute(self._q["concurrency_lock_jobs"], {"ids": params["ids"]})
            cur = await conn.execute(self._q["concurrency_admit"], params)
            return {uuid.UUID(str(r["id"])) for r in await cur.fetchall()}

    async def release(self, limits: Mapping[str, int], known: Sequence[str],
                      admitted_seconds: float, limit: int = 500) -> list[Job]:
        """Re-publish the jobs that waited for their key, as far as each key has room now;
        only jobs of the ``known`` workflows (those of ``limits`` by their limit, the others
        all: their limit was removed)."""
        params = {"limits": json.dumps(dict(limits)), "known": list(known),
                  "admitted_seconds": admitted_seconds, "limit": limit}
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q["concurrency_lock_held"])
            locked = await cur.fetchall()
            if not locked:
                return []
            params["tenants"] = [r["tenant_id"] for r in locked]
            params["keys"] = [r["key"] for r in locked]
            cur = await conn.execute(self._q["concurrency_release"], params)
            jobs = [Job.from_row(r) for r in await cur.fetchall()]
            await republish(conn, self._q["insert_outbox"], jobs)
        return jobs
