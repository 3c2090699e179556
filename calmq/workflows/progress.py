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
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from calmq import events, topics
from calmq.data import outbox
from calmq.data.attempts import Finish
from calmq.data.children import Children, ChildRows
from calmq.data.jobs import NewJob
from calmq.data.steps import StepRecord, StepRecords
from calmq.errors import ContractError, FailureClass, StepFailure
from calmq.jobs import EventType, Status
from calmq.workflows import Spawn, Step, StepOutput, Workflow

if TYPE_CHECKING:
    from calmq.data import Database, Job
    from calmq.objects import ObjectStore

__all__ = ["CHILDREN", "STEP_COMPLETED", "ChildLimits", "Progress", "artifact_key"]

# History event when a step finished and the job moved on to the next one.
STEP_COMPLETED = "step_completed"
# Recorded outputs in these states are final: the step is not run again.
_FINAL = ("done", "approved")
# The waiting reason of a job whose step started children, and the history event then; in a
# spawning step's recorded output, the key that says so (its next step gets the children
# there instead).
CHILDREN = "children"
CHILDREN_SPAWNED = "children_spawned"


@dataclass(frozen=True)
class ChildLimits:
    """Settings children_per_parent_max, children_depth_max and children_in_flight_max
    (docs/explanation/security.md)."""

    per_parent: int = 100_000
    depth: int = 3
    # children_in_flight_max: a spawn's children past it wait (parent_in_flight), and each
    # that ends releases the next (calmq/sql/migrations/0053_child_jobs.sql)
    in_flight: int = 1_000


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
    def __init__(self, db: Database, objects: ObjectStore, review_deadline_seconds: float,
                 *, workflows: Mapping[str, Workflow] | None = None,
                 limits: ChildLimits | None = None) -> None:
        self.steps = StepRecords(db)
        self.children = Children(db)
        self.objects = objects
        self.review_deadline_seconds = review_deadline_seconds
        # The workflows a step may start children of (the worker's): None, none.
        self.workflows = workflows or {}
        self.limits = limits or ChildLimits()

    async def joined(self, job: Job, data: dict[str, Any]) -> dict[str, Any]:
        """The input of the step after a spawning one: its output with ``children`` the
        children's outcomes in input order (references to their artifacts, or their errors);
        any other step's input as it is."""
        marker = data.get(CHILDREN)
        if not isinstance(marker, dict) or marker.get("spawned") is not True:
            return data
        found = await self.children.outcomes(job.id, str(marker.get("step", "")),
                                             int(marker.get("first", 0)))
        return {**data, CHILDREN: [c.as_input() for c in found]}

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
        if out.spawn is not None:
            return await self._spawn(job, workflow, out, out.spawn, base=base, tokens=tokens,
                                     record=record)
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

    async def _spawn(self, job: Job, workflow: Workflow, out: StepOutput, spawn: Spawn, *,
                     base: dict[str, Any], tokens: dict[str, int],
                     record: dict[str, Any]) -> Finish:
        """The step's output recorded, its children and their join written, and the job
        waiting for them (queued, waiting_reason children): all in the finish's transaction.
        The job holds no lease and no message meanwhile; the join's trigger re-publishes it
        for its next step, or dead-letters it (calmq/sql/migrations/0053_child_jobs.sql)."""
        step = workflow.step(job.step)
        following = workflow.next_step(step.name)
        if following is None:
            raise StepFailure(f"step {step.name} starts children but is the last step: a "
                              "next step joins them", code="spawn_without_next_step",
                              failure_class=FailureClass.BUG)
        child = self.workflows.get(spawn.workflow)
        if child is None:
            raise StepFailure(f"step {step.name} starts children of {spawn.workflow!r}, a "
                              "workflow this worker does not know", code="unknown_workflow",
                              failure_class=FailureClass.BUG)
        n = len(spawn.inputs)
        if n > self.limits.per_parent:
            raise StepFailure(f"step {step.name} starts {n} children; at most "
                              f"{self.limits.per_parent} per job (children_per_parent_max)",
                              code="too_many_children", failure_class=FailureClass.INPUT)
        depth = await self.children.ancestors(job.id, self.limits.depth)
        if depth + 1 > self.limits.depth:
            raise StepFailure(f"step {step.name} of a job nested {depth} deep starts children"
                              f"; at most {self.limits.depth} levels (children_depth_max)",
                              code="children_too_deep", failure_class=FailureClass.INPUT)
        first = child.steps[0]
        pool = spawn.pool or child.pool_of(first)
        lane = spawn.lane or job.lane
        priority = spawn.priority or job.priority
        route = topics.work_route(pool, priority, lane)
        trace = {"traceparent": job.trace_parent} if job.trace_parent else {}
        first_index = await self.children.next_index(job.id)
        rows: list[dict[str, Any]] = []
        for index, raw in enumerate(spawn.inputs):
            try:
                data = child.validate_input(raw)
            except ContractError as exc:
                raise StepFailure(f"child {index} of step {step.name}: {exc}",
                                  code="invalid_input", failure_class=FailureClass.INPUT
                                  ) from exc
            new = NewJob(id=uuid.uuid4(), tenant_id=job.tenant_id, workflow=child.name,
                         workflow_version=child.version, priority=priority, pool=pool,
                         step=first.name, max_attempts=first.attempts, input=data,
                         metadata=dict(job.metadata), deadline_at=job.deadline_at,
                         trace_parent=job.trace_parent, lane=lane,
                         concurrency_key=spawn.concurrency_key)
            requested = events.requested(new)
            rows.append({
                "id": str(new.id), "tenant_id": str(new.tenant_id), "workflow": new.workflow,
                "workflow_version": new.workflow_version, "priority": priority, "pool": pool,
                "step": new.step, "max_attempts": new.max_attempts, "input": data,
                "metadata": new.metadata, "trace_parent": new.trace_parent, "lane": lane,
                "deadline_at": new.deadline_at.isoformat() if new.deadline_at else None,
                "concurrency_key": new.concurrency_key, "child_index": first_index + index,
                "held": index >= self.limits.in_flight,
                "event_id": requested["event_id"], "route": route, "payload": requested,
                "headers": trace})
        next_pool = workflow.pool_of(following)
        moved = replace(job, step=following.name, attempt=0, pool=next_pool)
        resumed = events.requested(moved)
        resume = [{"route": topics.work_route(next_pool, job.priority, job.lane),
                   "type": "job.requested", "payload": resumed, "headers": trace}]
        fail = [{"route": topics.RESULTS_ROUTE, "type": "job.result",
                 "payload": events.result(moved, Status.DEAD_LETTER), "headers": trace},
                {"route": topics.DLQ_ROUTE, "type": "job.dead_lettered",
                 "payload": events.dead_lettered(moved, last_event=EventType.DEAD_LETTERED),
                 "headers": trace}]
        join = spawn.join
        summary = {"spawned": True, "step": step.name, "first": first_index,
                   "workflow": child.name, "count": n, "policy": join.kind,
                   "k": join.needed(n)}
        record.update(output={**out.artifact, CHILDREN: summary}, next_pool=next_pool,
                      next_max_attempts=following.attempts)
        return Finish(
            **base, status=Status.QUEUED, event_type=CHILDREN_SPAWNED,
            next_step=following.name, reset_attempt=True, waiting_reason=CHILDREN,
            event_detail={"step": step.name, "next_step": following.name, **summary,
                          "lane": lane, **tokens},
            record=record,
            spawn=ChildRows(step=step.name, policy=join.kind, k=join.needed(n),
                            children=rows, resume_outbox=resume, fail_outbox=fail),
        )

    async def write_artifact(self, job: Job, output: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(output, separators=(",", ":")).encode()
        key = artifact_key(job.tenant_id, job.id, job.step, job.lease_version)
        ref = await self.objects.put(key, body, "application/json")
        return dict(ref.as_dict())
