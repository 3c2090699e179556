"""Attempts: how each attempt ended, written for a whole group of jobs in one statement.

A worker collects ``Finish`` outcomes for a few milliseconds and hands the group to
``Attempts.finish`` (group commit): one ``finish_attempts`` statement moves every job, closes
its attempt row, writes its history event and its outbox entries.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg.types.json import Jsonb

from calmq.data.children import ChildRows
from calmq.data.database import Database
from calmq.data.outbox import OutboxEntry
from calmq.job_costs import Accepted

__all__ = ["Attempts", "Finish", "Moved"]

_NO_USAGE = {"model_calls": 0, "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0,
             "model": None, "cached_input_tokens": 0, "cache_write_tokens": 0,
             "cache_saved_usd": 0.0}


@dataclass(slots=True)
class Finish:
    """How one attempt ended: the job's next status, its history event, its outbox entries."""

    job_id: uuid.UUID
    worker: str
    step: str
    attempt: int
    status: str
    event_type: str
    outcome: str
    # The attempt's fencing token (Job.lease_version): the outcome is written only while the
    # job is still at it. 0 matches no claimed job, so a Finish that forgets it is refused.
    lease_version: int = 0
    event_detail: dict[str, Any] = field(default_factory=dict)
    artifact: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    next_step: str | None = None
    reset_attempt: bool = False
    outbox: list[OutboxEntry] = field(default_factory=list)
    # A workflow step's output to record with the move (calmq/workflows, wf_record_step_output):
    # {state, output, confidence, review_deadline_at, next_pool, next_max_attempts}.
    record: dict[str, Any] | None = None
    # The attempt's model calls: {model_calls, input_tokens, output_tokens, cost_usd, model,
    # cached_input_tokens, cache_write_tokens, cache_saved_usd} (model: the one that served
    # its last call, calmq.calls.fallback; the cache's: calmq.calls.caching).
    usage: dict[str, Any] | None = None
    # Why the job waits in its next status (a spawning step: "children", with ``spawn`` the
    # children and the join written in the same transaction, calmq.data.children).
    waiting_reason: str | None = None
    spawn: ChildRows | None = None

    def record_params(self) -> dict[str, Any]:
        """``wf_record_step_output``'s parameters (only for a Finish with a ``record``)."""
        assert self.record is not None
        r = self.record
        return {"job_id": self.job_id, "worker": self.worker, "step": self.step,
                "lease_version": self.lease_version, "state": r["state"],
                "output": Jsonb(r["output"]),
                "confidence": r.get("confidence"),
                "review_deadline_at": r.get("review_deadline_at"),
                "next_pool": r.get("next_pool"), "next_max_attempts": r.get("next_max_attempts")}

    def row(self, ord_: int) -> dict[str, Any]:
        """This outcome as one row of finish_attempts' JSON array (``ord``: its place)."""
        return {
            "job_id": str(self.job_id),
            "worker": self.worker,
            "step": self.step,
            "attempt": self.attempt,
            "lease_version": self.lease_version,
            "status": self.status,
            "event_type": self.event_type,
            "outcome": self.outcome,
            "event_detail": self.event_detail,
            "artifact": self.artifact,
            "error": self.error,
            "next_step": self.next_step,
            "reset_attempt": self.reset_attempt,
            "waiting_reason": self.waiting_reason,
            "outbox": [e.as_json(n) for n, e in enumerate(self.outbox)],
            **(self.usage or _NO_USAGE),
            "ord": ord_,
        }


class Moved(set[uuid.UUID]):
    """The jobs a group commit moved; ``accepted``: those it completed, with their whole
    cost (calmq.job_costs)."""

    def __init__(self, rows: Sequence[Any] = ()) -> None:
        super().__init__(r["id"] for r in rows)
        self.accepted = [Accepted(r["id"], r["workflow"], r["tenant_id"], r["cost_usd"])
                         for r in rows if r["status"] == "completed"]


class Attempts:
    """Group commit of finished attempts."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._q = db.q

    async def finish(self, finishes: Sequence[Finish]) -> Moved:
        """Record a group of finished attempts in ONE transaction (group commit); returns the
        jobs it moved. A job missing there was fenced: its attempt no longer held it."""
        if not finishes:
            return Moved()
        # Job rows are locked in id order, like claim and heartbeat, so that concurrent
        # group commits and heartbeats cannot deadlock.
        finishes = sorted(finishes, key=lambda f: f.job_id)
        records = [f.record_params() for f in finishes if f.record is not None]
        rows = Jsonb([f.row(n) for n, f in enumerate(finishes)])
        keep = self._db.keep_errors
        async with self._db.pool.connection() as conn:
            if not records:
                # One statement is its own transaction on this autocommit connection: no
                # BEGIN and COMMIT round trips, each of which held the rows locked while it
                # waited for a busy event loop (pg_stat_activity: "idle in transaction").
                cur = await conn.execute(self._q["finish_attempts"],
                                         {"rows": rows, "keep_errors": keep})
                return Moved(await cur.fetchall())
            async with conn.transaction(), conn.cursor() as cur:
                # Before finish_attempts: its lease guard is still true then.
                await cur.executemany(self._q["wf_record_step_output"], records)
                await cur.execute(self._q["finish_attempts"],
                                  {"rows": rows, "keep_errors": keep})
                moved = Moved(await cur.fetchall())
                # A spawning step's children and join: only with the parent's move (its
                # statements check the parent waits for them, so a fenced finish starts none).
                for f in finishes:
                    if f.spawn is not None and f.job_id in moved:
                        await f.spawn.write(cur, self._q, f.job_id)
                return moved
