"""Child jobs: the jobs a step starts, and the join their parent waits on (migration 0053).

A spawning step's children and its join record are written in the group commit that records
the step's output (``Attempts.finish``, ``ChildRows``); the join is decided by the database
in the transaction that settles a child (calmq_settle_child). This module reads them: the
children's outcomes for the parent's next step, and a page of children for the API.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from calmq import events, topics
from calmq.data.database import Database
from calmq.data.outbox import entry
from calmq.jobs import Status

__all__ = ["ChildOutcome", "ChildRows", "ChildView", "Children", "ChildrenSummary"]


@dataclass(slots=True)
class ChildRows:
    """What a spawning step's finish writes beside the parent's move: the children (rows of
    ``insert_children``) and the join (``insert_join``'s parameters but the parent)."""

    step: str
    policy: str
    k: int
    children: list[dict[str, Any]]
    resume_outbox: list[dict[str, Any]]
    fail_outbox: list[dict[str, Any]]

    async def write(self, cur: psycopg.AsyncCursor[Any], queries: Mapping[str, str],
                    parent_id: uuid.UUID) -> None:
        """Both, on the group commit's cursor (its transaction), after finish_attempts."""
        await cur.execute(queries["insert_join"], {
            "parent_id": parent_id, "step": self.step, "policy": self.policy, "k": self.k,
            "n": len(self.children), "resume_outbox": Jsonb(self.resume_outbox),
            "fail_outbox": Jsonb(self.fail_outbox)})
        await cur.execute(queries["insert_children"],
                          {"parent_id": parent_id, "step": self.step,
                           "jobs": Jsonb(self.children)})


@dataclass(frozen=True, slots=True)
class ChildOutcome:
    """One child as its parent's next step sees it."""

    job_id: uuid.UUID
    index: int
    status: str
    artifact: dict[str, Any] | None
    error: dict[str, Any] | None

    def as_input(self) -> dict[str, Any]:
        return {"index": self.index, "job_id": str(self.job_id), "status": self.status,
                "artifact": self.artifact, "error": self.error}


@dataclass(frozen=True, slots=True)
class ChildView:
    """A child in the API's page of children."""

    id: uuid.UUID
    index: int
    workflow: str
    status: str
    attempt: int
    step: str
    artifact: dict[str, Any] | None
    error: dict[str, Any] | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class ChildrenSummary:
    """A job's children counted by status, and its joins (newest first)."""

    counts: dict[str, int] = field(default_factory=dict)
    joins: list[dict[str, Any]] = field(default_factory=list)
    parent_id: uuid.UUID | None = None  # the job's own parent, if a step started it

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class Children:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def ancestors(self, job_id: uuid.UUID, limit: int) -> int:
        """How deep ``job_id`` is nested (0: nobody started it), counted up to ``limit``+1."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["children_ancestors"],
                                     {"id": job_id, "limit": limit})
            row = await cur.fetchone()
        return int(row["n"]) if row else 0

    async def outcomes(self, parent_id: uuid.UUID, step: str | None = None, first: int = 0
                       ) -> list[ChildOutcome]:
        """The children ``step`` of ``parent_id`` started (None: every step's), in input
        order (``index`` from 0: their child indexes start at ``first``)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["children_outcomes"],
                                     {"parent_id": parent_id, "step": step})
            rows = await cur.fetchall()
        return [ChildOutcome(r["id"], r["child_index"] - first, r["status"], r["artifact"],
                             r["error"]) for r in rows]

    async def next_index(self, parent_id: uuid.UUID) -> int:
        """The first child index of a new spawn of ``parent_id`` (after earlier spawns')."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["children_next_index"],
                                     {"parent_id": parent_id})
            row = await cur.fetchone()
        return int(row["n"]) if row else 0

    async def page(self, tenant_id: uuid.UUID, parent_id: uuid.UUID, *, after: int = -1,
                   limit: int = 100) -> list[ChildView]:
        """Up to ``limit`` children of the tenant's job, in input order, after ``after``."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["children_page"], {
                "tenant_id": tenant_id, "parent_id": parent_id, "after": after,
                "limit": limit})
            rows = await cur.fetchall()
        return [ChildView(r["id"], r["child_index"], r["workflow"], r["status"], r["attempt"],
                          r["step"], r["artifact"], r["error"], r["created_at"],
                          r["updated_at"]) for r in rows]

    async def cancel_tree(self, tenant_id: uuid.UUID, job_id: uuid.UUID, by: str
                          ) -> list[uuid.UUID]:
        """Cancel every descendant of the tenant's job that has not ended, at every level,
        in one transaction of two statements: the cancels with their history
        (children_cancel_tree) and each one's job.result (children_results), as a cancel of
        each would write them. Returns the ids cancelled."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._db.q["children_cancel_tree"],
                                     {"id": job_id, "tenant_id": tenant_id, "by": by})
            rows = await cur.fetchall()
            if rows:
                results = [entry(topics.RESULTS_ROUTE, "job.result",
                                 events.result(r, Status.CANCELLED), key=r["id"],
                                 trace_parent=r["trace_parent"]).as_json(n)
                           for n, r in enumerate(rows)]
                await conn.execute(self._db.q["children_results"], {"rows": Jsonb(results)})
        return [r["id"] for r in rows]

    async def summary(self, tenant_id: uuid.UUID, parent_id: uuid.UUID) -> ChildrenSummary:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["children_counts"],
                                     {"tenant_id": tenant_id, "parent_id": parent_id})
            row = await cur.fetchone()
        if row is None:
            return ChildrenSummary()
        return ChildrenSummary({k: int(v) for k, v in row["counts"].items()}, row["joins"],
                               row["parent_id"])
