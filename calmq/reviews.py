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

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any, Literal

from prometheus_client import Histogram

from calmq import events, topics
from calmq.data import Database
from calmq.data.jobs import requested
from calmq.data.outbox import entry
from calmq.data.reviews import PendingReview, ReviewDecision, ReviewJob, Reviews
from calmq.errors import ContractError, NotFound, StepFailure
from calmq.job_costs import Accepted, count_accepted
from calmq.jobs import EventType, Status
from calmq.objects import ObjectStore
from calmq.storable import non_finite
from calmq.workflows import Workflow
from calmq.workflows.progress import artifact_key

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
    note: str | None = None  # free text the caller sent as a reviewer name (kept, not trusted)


class ReviewDesk:
    """Review operations over the database; the API and the review timer share them."""

    def __init__(self, db: Database, workflows: dict[str, Workflow], objects: ObjectStore) -> None:
        self.reviews = Reviews(db)
        self.workflows = workflows
        self.objects = objects

    async def pending(
        self, tenant_id: uuid.UUID, *, limit: int = 100,
        after: tuple[datetime, uuid.UUID] | None = None,
    ) -> list[PendingReview]:
        """The tenant's jobs awaiting review, oldest first, with the model's output."""
        after_at, after_id = after or (_EPOCH, uuid.UUID(int=0))
        return await self.reviews.pending(tenant_id, limit=limit, after_at=after_at,
                                          after_id=after_id)

    async def decide(self, tenant_id: uuid.UUID, job_id: uuid.UUID, decision: Decision) -> str:
        """Apply a person's decision; returns the job's new status.

        NotFound for a job that is not the tenant's; ContractError 409 ``not_awaiting_review``
        when the job is not waiting for a review; 422 ``invalid_fields`` when corrected fields
        do not fit the step's output model.
        """
        async with self.reviews.decision() as tx:
            job = await tx.lock(tenant_id, job_id)
            if job is None:
                raise NotFound("no such job")
            if job.status != Status.AWAITING_REVIEW:
                raise ContractError(f"the job is {job.status}, not awaiting_review",
                                    code="not_awaiting_review", status=409)
            status = await self._apply(tx, job, decision, expired=False)
        _accepted(job, status)  # once the decision committed
        return status

    async def expire(self, *, limit: int = 100) -> int:
        """Apply the expiry outcome to reviews past their deadline; returns how many."""
        done = 0
        for job_id in await self.reviews.expired(limit):
            async with self.reviews.decision() as tx:
                job = await tx.lock_expired(job_id)
                if job is None:  # decided meanwhile, or a reviewer holds it right now
                    continue
                workflow = self.workflows.get(job.workflow)
                outcome = workflow.review_expiry if workflow is not None else "dead_letter"
                decision = Decision(
                    "approve" if outcome == "approve" else "reject", TIMER_REVIEWER,
                    reason="the review deadline passed",
                )
                status = await self._apply(tx, job, decision, expired=True)
            _accepted(job, status)
            done += 1
        return done

    # -- one decision, inside its transaction --------------------------------------------

    async def _apply(
        self, tx: ReviewDecision, job: ReviewJob, decision: Decision, *, expired: bool,
    ) -> str:
        recorded = await tx.step_output(job)
        output: dict[str, Any] = recorded or {}
        workflow = self.workflows.get(job.workflow)
        detail: dict[str, Any] = {"decision": decision.decision, "reviewer": decision.reviewer,
                                  "step": job.step}
        if job.updated_at is not None:  # entered awaiting_review then
            waited = (datetime.now(UTC) - job.updated_at).total_seconds()
            outcome = "expired" if expired else decision.decision
            _review_wait().labels(outcome).observe(max(0.0, waited))
        if decision.note:
            detail["reviewer_note"] = decision.note
        if expired:
            detail["expired"] = True
        if decision.decision == "reject" or workflow is None:
            await tx.add_event(job, EventType.REVIEWED, detail)
            if recorded is not None:
                await tx.set_step_output(job, "rejected", output, decision.reviewer)
            return await self._dead_letter(tx, job, expired, decision)
        step = workflow.step(job.step)
        if decision.fields:
            # The event records the fields as given (also those the output model drops):
            # jsonb holds no infinity, so one there is the reviewer's error, not a 5xx.
            found = non_finite(decision.fields, "fields")
            if found is not None:
                raise ContractError(f"{found} is a number that is not finite",
                                    code="non_finite_number")
            detail["fields"] = decision.fields
            try:
                output = step.check_output({**output, **decision.fields})
            except StepFailure as exc:
                raise ContractError(f"the corrected fields do not fit: {exc.message}",
                                    code="invalid_fields", status=422) from exc
        await tx.add_event(job, EventType.REVIEWED, detail)
        await tx.set_step_output(job, "approved", output, decision.reviewer)
        following = workflow.next_step(step.name)
        if following is not None:
            pool = workflow.pool_of(following)
            moved = await tx.resume(job, following.name, pool, following.attempts)
            # Through the one job.requested builder: an approved job keeps its lane.
            await tx.emit([requested(moved)])
            await tx.add_event(job, EventType.QUEUED, {"step": following.name, "pool": pool})
            return Status.QUEUED
        ref = await self.objects.put(artifact_key(job.tenant_id, job.id, job.step),
                                     _json(output), "application/json")
        artifact = dict(ref.as_dict())
        await tx.complete(job, artifact)
        await tx.add_event(job, EventType.COMPLETED, {"artifact": artifact["uri"]})
        await tx.emit([entry(topics.RESULTS_ROUTE, "job.result",
                             events.result(job, Status.COMPLETED, artifact=artifact),
                             key=job.id, trace_parent=job.trace_parent)])
        return Status.COMPLETED

    async def _dead_letter(
        self, tx: ReviewDecision, job: ReviewJob, expired: bool, decision: Decision,
    ) -> str:
        if expired:
            error = {"code": "review_expired", "class": "deadline",
                     "message": "nobody reviewed the job before its review deadline"}
        else:
            error = {"code": "review_rejected", "class": "verifier",
                     "message": (decision.reason or f"rejected by {decision.reviewer}")[:1000]}
        await tx.dead_letter(job, error)
        await tx.add_event(job, EventType.DEAD_LETTERED, error)
        dead = events.dead_lettered(job, errors=[{**error, "attempt": job.attempt}],
                                    last_event=EventType.DEAD_LETTERED)
        await tx.emit([
            entry(topics.RESULTS_ROUTE, "job.result",
                  events.result(job, Status.DEAD_LETTER, error=error), key=job.id,
                  trace_parent=job.trace_parent),
            entry(topics.DLQ_ROUTE, "job.dead_lettered", dead, key=job.id,
                  trace_parent=job.trace_parent),
        ])
        return Status.DEAD_LETTER


def _accepted(job: ReviewJob, status: str) -> None:
    """An approval that completed the job: counted in the cost per accepted job."""
    if status == Status.COMPLETED:
        count_accepted([Accepted(job.id, job.workflow, job.tenant_id, job.cost_usd)])


def _json(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
