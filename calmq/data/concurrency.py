"""Concurrency keys as rows (calmq/sql/concurrency.sql, migration 0045): a job's
``concurrency_key`` (a customer inside its tenant, given at submit), and the jobs that wait
for their key's room (``waiting_reason`` ``concurrency_key``), or, past their tenant's
cap on waiting keys, behind its keys (``concurrency_keys_waiting``). The limit per key is
the workflow's ``concurrency_limit``; what waits when is calmq.processors.admission's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from calmq.data.database import Database
from calmq.data.jobs import Job, republish

__all__ = ["ConcurrencyKeys", "ReleasePass"]


@dataclass(frozen=True, slots=True)
class ReleasePass:
    """What one release pass did: ``ran`` False when another process's pass held the
    fleet's turn; the keys it locked, the jobs it re-published, and how many jobs that
    waited behind their tenant's keys now wait for their own (``promoted``)."""

    ran: bool
    keys: list[tuple[uuid.UUID, str]] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    promoted: int = 0


# Before every (tenant, key): a key is at least one character.
_FIRST = (uuid.UUID(int=0), "")


class ConcurrencyKeys:
    """Admission and release by concurrency key. ``batch``: the keys one release pass locks
    at most; the pass's cursor (the last key it locked) is this object's, so each process
    that runs passes moves through every waiting key in turn."""

    def __init__(self, db: Database, *, batch: int = 256) -> None:
        self._db = db
        self._q = db.q
        self.batch = batch
        self._cursor: tuple[uuid.UUID, str] | None = None

    async def admit(self, ids: Sequence[uuid.UUID], limits: Mapping[str, int],
                    admitted_seconds: float, *, waiting_max: int) -> dict[uuid.UUID, str]:
        """Admit the jobs of ``ids`` that fit under their keys' limits (``limits``: per
        workflow) and hold the rest; returns those held, with why (``concurrency_key``, or
        ``concurrency_keys_waiting`` past the tenant's ``waiting_max`` waiting keys). The
        keys are locked first, in the same transaction, so that admissions of one key across
        the fleet take turns."""
        if not ids or not limits:
            return {}
        params = {"ids": list(ids), "limits": json.dumps(dict(limits)),
                  "admitted_seconds": admitted_seconds, "waiting_max": waiting_max}
        async with self._db.pool.connection() as conn, conn.transaction():
            await conn.execute(self._q["concurrency_lock_jobs"], {"ids": params["ids"]})
            cur = await conn.execute(self._q["concurrency_admit"], params)
            return {uuid.UUID(str(r["id"])): r["reason"] for r in await cur.fetchall()}

    async def release(self, limits: Mapping[str, int], known: Sequence[str],
                      admitted_seconds: float, *, waiting_max: int,
                      limit: int = 500) -> ReleasePass:
        """Re-publish the jobs that waited for their key, as far as each key has room now;
        only jobs of the ``known`` workflows (those of ``limits`` by their limit, the others
        all: their limit was removed). Then the jobs that waited behind their tenant's keys
        take the places its keys left (``waiting_max`` per tenant). One pass at a time in
        the fleet, at most ``batch`` keys locked."""
        async with self._db.pool.connection() as conn, conn.transaction():
            return await self.release_on(conn, limits, known, admitted_seconds,
                                         waiting_max=waiting_max, limit=limit)

    async def release_on(self, conn: AsyncConnection[DictRow], limits: Mapping[str, int],
                         known: Sequence[str], admitted_seconds: float, *, waiting_max: int,
                         limit: int = 500) -> ReleasePass:
        """``release`` in the caller's transaction on ``conn``: the locks it takes (the
        fleet's pass, each key's) are held until that transaction ends."""
        cur = await conn.execute(self._q["concurrency_release_lock"])
        row = await cur.fetchone()
        if row is None or not row["held"]:
            return ReleasePass(ran=False)  # another process's pass runs now
        locked = await self._next_keys(conn, known)
        jobs: list[Job] = []
        if locked:
            cur = await conn.execute(self._q["concurrency_release"], {
                "limits": json.dumps(dict(limits)), "known": list(known),
                "admitted_seconds": admitted_seconds, "limit": limit,
                "tenants": [t for t, _k in locked], "keys": [k for _t, k in locked]})
            jobs = [Job.from_row(r) for r in await cur.fetchall()]
            await republish(conn, self._q["insert_outbox"], jobs)
        # After the release: the keys it let go are room for the jobs behind them.
        cur = await conn.execute(self._q["concurrency_promote_overflow"], {
            "waiting_max": waiting_max, "limit": limit})
        row = await cur.fetchone()
        return ReleasePass(ran=True, keys=locked, jobs=jobs,
                           promoted=int(row["n"]) if row is not None else 0)

    async def _next_keys(self, conn: AsyncConnection[DictRow],
                         known: Sequence[str]) -> list[tuple[uuid.UUID, str]]:
        """Lock the next ``batch`` waiting keys after the cursor (from the first again once
        the cursor is past the last) and move the cursor to the last of them."""
        for after in ((self._cursor, _FIRST) if self._cursor is not None else (_FIRST,)):
            cur = await conn.execute(self._q["concurrency_lock_held"], {
                "known": list(known), "batch": self.batch,
                "after_tenant": after[0], "after_key": after[1]})
            locked = [(r["tenant_id"], r["key"]) for r in await cur.fetchall()]
            # A short batch reached the last key: the next pass starts from the first.
            self._cursor = locked[-1] if len(locked) >= self.batch else None
            if locked:
                return locked
        return []
