"""Human review: the decisions on jobs waiting in ``awaiting_review``, one transaction each.

A job waits for a person when a step's confidence was below its workflow's threshold. It
holds no lease, no worker slot and no open transaction while it waits: it is a row with a
deadline. A decision (``approve`` with optional corrected ``fields``, or ``reject``) is
recorded in the history as ``reviewed`` with the reviewer, and in the same transaction the
job moves on: to its next step (a ``job.requested`` through the outbox), to ``completed``
(the last step's reviewed output is the artifact), or to ``dead_letter`` (class
``verifier``, code ``review_rejected``). The review timer applies the workflow's
``review_expiry`` to reviews nobody decided before their deadline.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any, Literal

import psycopg
from prometheus_client import Histogram
from psycopg.types.json import Jsonb

from calmq import events, sql, topics
from calmq.data import Store
from calmq.errors import ContractError, NotFound, StepFailure
from calmq.jobs import EventType, Status
from calmq.objects import ObjectStore
from calmq.workflows import Workflow
from calmq.workflows.progress import artifact_key, traceparent

__all__ = ["TIMER_REVIEWER", "Decision", "ReviewDesk"]


@cache
def _review_wait() -> Histogram:
    # Created on first use (API: decisions; worker: the review timer); outcome is bounded.
    return Histogram("calmq_review_wait_seconds",
                     "Time a job waited in awaiting_review before its decision",
                     ["outcome"], buckets=(1, 10, 60, 300, 900, 3600, 4 * 3600, 12 * 3600,
                                           24 * 3600, 48 * 3600, 7 * 24 * 3600))

# The reviewer named in the history when the deadline, not a person, decided.
TIMER_REVIEWER = "calmq:review-timer"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Decision:
    decision: Literal["approve", "reject"]
    reviewer: str
    fields: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None


class ReviewDesk:
    """Review operations over the store; the API and the review timer share them."""

    def __init__(self, store: Store, workflows: dict[str, Workflow], objects: ObjectStore) -> None:
        self.store = store
        self.workflows = workflows
        self.objects = objects
        self._q = sql.queries()

    async def pending(
        self, tenant_id: uuid.UUID, *, limit: int = 100,
        after: tuple[datetime, uuid.UUID] | None = None,
    ) -> list[dict[str, Any]]:
        """The tenant's jobs awaiting review, oldest first, with the model's output."""
        after_at, after_id = after or (_EPOCH, uuid.UUID(int=0))
        async with self.store.pool.connection() as conn:
            cur = await conn.execute(
                self._q["wf_pending_reviews"],
                {"tenant_id": tenant_id, "limit": limit, "after_at": after_at,
                 "after_id": after_id},
            )
            rows: list[dict[str, Any]] = await cur.fetchall()
        return rows

    async def decide(self, tenant_id: uuid.UUID, job_id: uuid.UUID, decision: Decision) -> str:
        """Apply a person's decision; returns the job's new status.

        NotFound for a job that is not the tenant's; ContractError 409 ``not_awaiting_review``
        when the job is not waiting for a review; 422 ``invalid_fields`` when corrected fields
        do not fit the step's output model.
        """
        async with self.store.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q["wf_lock_job"], {"id": job_id, "tenant_id": tenant_id})
            job = await cur.fetchone()
            if job is None:
                raise NotFound("no such job")
            if job["status"] != Status.AWAITING_REVIEW:
                raise ContractError(f"the job is {job['status']}, not awaiting_review",
                                    code="not_awaiting_review", status=409)
            return await self._apply(conn, job, decision, expired=False)

    async def expire(self, *, limit: int = 100) -> int:
        """Apply the expiry outcome to reviews past their deadline; returns how many."""
        async with self.store.pool.connection() as conn:
            cur = await conn.execute(self._q["wf_expired_reviews"], {"limit": limit})
            due = [r["id"] for r in await cur.fetchall()]
        done = 0
        for job_id in due:
            async with self.store.pool.connection() as conn, conn.transaction():
                cur = await conn.execute(self._q["wf_lock_expired_review"], {"id": job_id})
                job = await cur.fetchone()
                if job is None:  # decided meanwhile, or a reviewer holds it right now
                    continue
                workflow = self.workflows.get(job["workflow"])
                outcome = workflow.review_expiry if workflow is not None else "dead_letter"
                decision = Decision(
                    "approve" if outcome == "approve" else "reject", TIMER_REVIEWER,
                    reason="the review deadline passed",
                )
                await self._apply(conn, job, decision, expired=True)
                done += 1
        return done

    # -- one decision, inside the caller's transaction ----------------------------------

    async def _apply(
        self, conn: psycopg.AsyncConnection[Any], job: dict[str, Any], decision: Decision,
        *, expired: bool,
    ) -> str:
        cur = await conn.execute(self._q["wf_lock_step_output"],
                                 {"job_id": job["id"], "step": job["step"]})
        recorded = await cur.fetchone()
        output: dict[str, Any] = dict(recorded["output"]) if recorded else {}
        workflow = self.workflows.get(job["workflow"])
        detail: dict[str, Any] = {"decision": decision.decision, "reviewer": decision.reviewer,
                                  "step": job["step"]}
        if job.get("updated_at") is not None:  # entered awaiting_review then
            waited = (datetime.now(UTC) - job["updated_at"]).total_seconds()
            outcome = "expired" if expired else decision.decision
            _review_wait().labels(outcome).observe(max(0.0, waited))
        if expired:
            detail["expired"] = True
        if decision.decision == "reject" or workflow is None:
            await self._event(conn, job, EventType.REVIEWED, detail)
            if recorded is not None:
                await self._set_output(conn, job, "rejected", output, decision.reviewer)
            return await self._dead_letter(conn, job, expired, decision)
        step = workflow.step(job["step"])
        if decision.fields:
            detail["fields"] = decision.fields
            try:
                output = step.check_output({**output, **decision.fields})
            except StepFailure as exc:
                raise ContractError(f"the corrected fields do not fit: {exc.message}",
                                    code="invalid_fields", status=422) from exc
        await self._event(conn, job, EventType.REVIEWED, detail)
        await self._set_output(conn, job, "approved", output, decision.reviewer)
        following = workflow.next_step(step.name)
        if following is not None:
            pool = workflow.pool_of(following)
            cur = await conn.execute(
                self._q["wf_review_resume"],
                {"id": job["id"], "next_step": following.name, "pool": pool,
                 "max_attempts": following.attempts},
            )
            moved = await cur.fetchone()
            assert moved is not None
            ev = events.requested(moved)
            await self._outbox(conn, job, topics.work_route(pool, job["priority"]),
                               "job.requested", ev, headers=traceparent(job))
            await self._event(conn, job, EventType.QUEUED,
                              {"step": following.name, "pool": pool})
            return Status.QUEUED
        ref = await self.objects.put(artifact_key(job), _json(output), "application/json")
        artifact = dict(ref.as_dict())
        await conn.execute(self._q["wf_review_complete"],
                           {"id": job["id"], "artifact": Jsonb(artifact)})
        await self._event(conn, job, EventType.COMPLETED, {"artifact": artifact["uri"]})
        await self._outbox(conn, job, topics.RESULTS_ROUTE, "job.result",
                           events.result(job, Status.COMPLETED, artifact=artifact))
        return Status.COMPLETED

    async def _dead_letter(
        self, conn: psycopg.AsyncConnection[Any], job: dict[str, Any], expired: bool,
        decision: Decision,
    ) -> str:
        if expired:
            error = {"code": "review_expired", "class": "deadline",
                     "message": "nobody reviewed the job before its review deadline"}
        else:
            error = {"code": "review_rejected", "class": "verifier",
                     "message": (decision.reason or f"rejected by {decision.reviewer}")[:1000]}
        await conn.execute(self._q["wf_review_dead_letter"],
                           {"id": job["id"], "error": Jsonb(error)})
        await self._event(conn, job, EventType.DEAD_LETTERED, error)
        await self._outbox(conn, job, topics.RESULTS_ROUTE, "job.result",
                           events.result(job, Status.DEAD_LETTER, error=error))
        dead = events.dead_lettered(job, errors=[{**error, "attempt": job["attempt"]}],
                                    last_event=EventType.DEAD_LETTERED)
        await self._outbox(conn, job, topics.DLQ_ROUTE, "job.dead_lettered", dead)
        return Status.DEAD_LETTER

    async def _set_output(
        self, conn: psycopg.AsyncConnection[Any], job: dict[str, Any], state: str,
        output: dict[str, Any], reviewer: str,
    ) -> None:
        await conn.execute(self._q["wf_review_step_output"],
                           {"job_id": job["id"], "step": job["step"], "state": state,
                            "output": Jsonb(output), "reviewer": reviewer})

    async def _event(
        self, conn: psycopg.AsyncConnection[Any], job: dict[str, Any], type_: str,
        detail: dict[str, Any],
    ) -> None:
        await conn.execute(self._q["wf_insert_event"],
                           {"job_id": job["id"], "type": type_, "attempt": job["attempt"],
                            "detail": Jsonb(detail)})

    async def _outbox(
        self, conn: psycopg.AsyncConnection[Any], job: dict[str, Any], route: str, type_: str,
        payload: dict[str, Any], *, headers: dict[str, str] | None = None,
    ) -> None:
        await conn.execute(self._q["insert_outbox"],
                           {"id": payload["event_id"], "route": route,
                            "aggregateid": str(job["id"]), "type": type_,
                            "payload": Jsonb(payload),
                            # every event of the job carries the request's trace
                            "headers": Jsonb(headers or traceparent(job))})


def _json(value: dict[str, Any]) -> bytes:
    import json

    return json.dumps(value, separators=(",", ":")).encode()
