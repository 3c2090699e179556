"""Workflow steps: each job's recorded step outputs, and the log of side effects.

A step's output is written with the job's move to its next step (calmq.data.attempts runs
that query in the group commit); this module reads them back, so that a resumed job skips
the steps already done. The side-effect log records an external call's intent before the
call and its answer after it (calmq.workflows.effects): each record is its own commit,
durable before the call is made, and is taken only from the attempt that holds the job (its
fencing token): a stale attempt gets ``LeaseLost`` and makes no call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from psycopg.types.json import Jsonb

from calmq.data.database import Database
from calmq.errors import LeaseLost

__all__ = ["EffectRecord", "SideEffects", "StepRecord", "StepRecords"]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A step's recorded output: ``state`` is done, pending_review, approved or rejected."""

    step: str
    state: str
    output: dict[str, Any]
    confidence: float | None = None


@dataclass(slots=True)
class EffectRecord:
    """A side effect of a job: ``called`` (intent recorded, ``calls`` times) or
    ``confirmed`` (with the external system's ``response``)."""

    state: Literal["called", "confirmed"]
    calls: int
    response: dict[str, Any] | None = None


class StepRecords:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def outputs(self, job_id: uuid.UUID) -> dict[str, StepRecord]:
        """The job's recorded step outputs, by step."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["wf_step_outputs"], {"job_id": job_id})
            rows = await cur.fetchall()
        return {r["step"]: StepRecord(r["step"], r["state"], r["output"], r["confidence"])
                for r in rows}


class SideEffects:
    """The effect log in PostgreSQL (table side_effects); a ``calmq.workflows.EffectLog``.

    One per attempt: its writes carry the attempt's worker and fencing token
    (``lease_version``), and raise ``LeaseLost`` once the job is no longer the attempt's.
    """

    def __init__(self, db: Database, worker: str, lease_version: int) -> None:
        self._db = db
        self._fence = {"worker": worker, "lease_version": lease_version}

    async def lookup(self, job_id: str, key: str) -> EffectRecord | None:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["wf_effect_get"], {"job_id": job_id, "key": key})
            row = await cur.fetchone()
        return EffectRecord(row["state"], row["calls"], row["response"]) if row else None

    async def called(self, job_id: str, key: str) -> int:
        """Record the intent before the call; returns how many calls it has had."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["wf_effect_called"],
                                     {"job_id": job_id, "key": key, **self._fence})
            row = await cur.fetchone()
        if row is None or not row["held"]:
            raise LeaseLost(f"job {job_id} is no longer this attempt's: effect {key} not called")
        return int(row["calls"] or 0)

    async def confirmed(self, job_id: str, key: str, response: dict[str, Any]) -> None:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["wf_effect_confirmed"],
                                     {"job_id": job_id, "key": key, "response": Jsonb(response),
                                      **self._fence})
            row = await cur.fetchone()
        if row is None or not row["held"]:
            raise LeaseLost(f"job {job_id} is no longer this attempt's: the answer of effect "
                            f"{key} is not recorded")
