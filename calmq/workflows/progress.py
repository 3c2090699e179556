"""Durable progress through a workflow: what a worker does around a step.

Before a step runs: the outputs recorded for the job (a step whose output is recorded is
skipped, not run again) and the step's input (the job's input for the first step, the
previous step's recorded output after that). After it ran: the ``Finish`` that records the
output with the job and, in the same transaction, moves the job to its next step (a
``job.requested`` on that step's pool), to ``awaiting_review``, or to ``completed``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from calmq import events, topics
from calmq.data import outbox
from calmq.data.attempts import Finish
from calmq.data.steps import StepRecord, StepRecords
from calmq.errors import FailureClass, StepFailure
from calmq.jobs import EventType, Status
from calmq.workflows import Step, StepOutput, Workflow

if TYPE_CHECKING:
    from calmq.data import Database, Job
    from calmq.objects import ObjectStore

__all__ = ["STEP_COMPLETED", "Progress", "artifact_key"]

# History event when a step finished and the job moved on to the next one.
STEP_COMPLETED = "step_completed"
# Recorded outputs in these states are final: the step is not run again.
_FINAL = ("done", "approved")


def artifact_key(tenant_id: uuid.UUID, job_id: uuid.UUID, step: str,
                 lease_version: int | None = None) -> str:
    """Where a step's artifact goes: by the attempt's fencing token (``lease_version``), so
    a stale attempt's artifact lands beside the winner's and the finishing transaction
    points the job at the one that won; without one, the artifact a review completes."""
    # One folder per tenant, not per job: on a filesystem store a new folder per job cost a
    # millisecond of journal work on every completion, serialized on the parent folder.
    if lease_version is None:
        return f"{tenant_id}/artifacts/{job_id}.{step}.json"
    return f"{tenant_id}/artifacts/{job_id}.{step}.{lease_version}.json"


class Progress:
    def __init__(self, db: Database, objects: ObjectStore, review_deadline_seconds: float) -> None:
        self.steps = StepRecords(db)
        self.objects = objects
        self.review_deadline_seconds = review_deadline_seconds

    async def recorded(self, job: Job, workflow: Workflow) -> dict[str, StepRecord]:
        """The recorded step outputs of a multi-step job, by step (one-step jobs: none)."""
        if len(workflow.steps) < 2:
            return {}
        return await self.steps.outputs(job.id)

    @staticmethod
    def replay(step: Step, recorded: dict[str, StepRecord]) -> StepOutput | None:
        """The output of a step that ran (and was reviewed) already, to move on without it."""
        row = recorded.get(step.name)
        if row is None or row.state not in _FINAL:
            return None
        return StepOutput(artifact=dict(row.output), confidence=None)

    @staticmethod
    def step_input(
        workflow: Workflow, step: Step, recorded: dict[str, StepRecord]
    ) -> dict[str, Any] | None:
        """The previous step's recorded output; None for the first step (the job's input)."""
        previous = workflow.previous_step(step.name)
        if previous is None:
            return None
        row = recorded.get(previous.name)
        if row is None or row.state not in _FINAL:
            raise StepFailure(
                f"step {step.name} has no recorded output of {previous.name} to start from",
                code="missing_step_output", failure_class=FailureClass.BUG,
            )
        return dict(row.output)

    async def succeeded(
        self, job: Job, workflow: Workflow, out: StepOutput, worker: str
    ) -> Finish:
        step = workflow.step(job.step)
        base: dict[str, Any] = {"job_id": job.id, "worker": worker, "step": step.name,
                                "attempt": job.attempt, "lease_version": job.lease_version,
                                "outcome": "completed"}
        tokens = {"input_tokens": out.input_tokens, "output_tokens": out.output_tokens}
        record: dict[str, Any] = {"state": "done", "output": out.artifact,
                                  "confidence": out.confidence}
        if workflow.needs_review(out.confidence):
            seconds = workflow.review_deadline_seconds or self.review_deadline_seconds
            deadline = datetime.now(UTC) + timedelta(seconds=seconds)
            record.update(state="pending_review", review_deadline_at=deadline)
            return Finish(
                **base, status=Status.AWAITING_REVIEW, event_type=EventType.REVIEW_REQUESTED,
                event_detail={"step": step.name, "confidence": out.confidence,
                              "output": out.artifact, "threshold": workflow.review_threshold,
                              "deadline_at": deadline.isoformat(), **tokens},
                record=record,
            )
        following = workflow.next_step(step.name)
        if following is not None:
            pool = workflow.pool_of(following)
            record.update(next_pool=pool, next_max_attempts=following.attempts)
            moved = replace(job, step=following.name, attempt=0, pool=pool)
            requested = events.requested(moved)
            return Finish(
                **base, status=Status.QUEUED, event_type=STEP_COMPLETED,
                next_step=following.name, reset_attempt=True,
                event_detail={"step": step.name, "next_step": following.name, "pool": pool,
                              **tokens},
                record=record,
                outbox=[outbox.entry(topics.work_route(pool, job.priority, job.lane),
                                     "job.requested",
                                     requested, key=job.id,
                                     trace_parent=job.trace_parent)],
            )
        artifact = await self.write_artifact(job, out.artifact)
        result = events.result(job, Status.COMPLETED, artifact=artifact)
        return Finish(
            **base, status=Status.COMPLETED, event_type=EventType.COMPLETED, artifact=artifact,
            event_detail={"artifact": artifact["uri"], **tokens},
            record=record if len(workflow.steps) > 1 else None,
            outbox=[outbox.entry(topics.RESULTS_ROUTE, "job.result", result, key=job.id,
                                 trace_parent=job.trace_parent)],
        )

    async def write_artifact(self, job: Job, output: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(output, separators=(",", ":")).encode()
        key = artifact_key(job.tenant_id, job.id, job.step, job.lease_version)
        ref = await self.objects.put(key, body, "application/json")
        return dict(ref.as_dict())
