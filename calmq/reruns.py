"""Rerun from a step: a new job that runs a job that ended again from one of its steps.

After a prompt fix, the jobs that took the bad path run again from the step that changed,
without paying again for the steps before it. A rerun is a new job (a new id, its own
history, ``rerun_of`` naming the original) that starts at ``from_step`` with the original's
recorded outputs of the earlier steps copied (by reference: the JSON the steps recorded,
with whatever object references it holds), so a worker skips them as it skips the steps a
resumed job had done (calmq.workflows.progress): no paid call of theirs is made again.

It is a submit like any other: it runs under today's version of the workflow, in that
step's pool and with its attempt budget, and counts against its tenant's quotas, spend caps
and fair share like any job (those hold at the claim, not at the intake). Refusals, each
with a stable code: the job does not exist (or is another tenant's, or was deleted), it has
not ended (``job_not_terminal``: a rerun starts from a job that is completed, dead-lettered
or cancelled, never beside a run still in flight), its workflow has no such step
(``unknown_step``), a step before it has no recorded output to start from
(``step_outputs_missing``), or the replacement input does not fit (``invalid_input``).

The replacement input, when given, is what ``from_step`` gets: the job's input when it is
the first step (held to the workflow's input model), otherwise the previous step's output
(held to that step's output model), recorded in the rerun in place of the original's.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from calmq.data import Database, Idempotency, NewJob
from calmq.data.children import Children
from calmq.data.reruns import Original, RerunRecords
from calmq.errors import ContractError, NotFound, StepFailure
from calmq.jobs import TERMINAL, Priority, new_id
from calmq.lanes import ONLINE
from calmq.workflows import Workflow, find_workflow
from calmq.workflows.progress import CHILDREN

__all__ = ["Rerun", "RerunPlan", "Reruns"]


@dataclass(frozen=True, slots=True)
class RerunPlan:
    """How a rerun runs: its new job, the steps copied from the original, the replaced
    output (the step whose recorded output the replacement input takes the place of)."""

    job: NewJob
    from_step: str
    copy_steps: tuple[str, ...]
    replaced_step: str | None
    replacement: dict[str, Any] | None
    # The steps it runs again: from_step and every one after it.
    rerun_steps: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Rerun:
    """A rerun written: the new job's id, and the job it reruns."""

    job_id: uuid.UUID
    rerun_of: uuid.UUID
    from_step: str
    # False: an Idempotency-Key answered before with the same request; its rerun, not a new
    created: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": str(self.job_id), "status": "queued",
                "status_url": f"/v1/jobs/{self.job_id}", "rerun_of": str(self.rerun_of),
                "from_step": self.from_step}


class Reruns:
    """Plans and writes reruns; an API request and the CLI's bulk rerun share it."""

    def __init__(self, db: Database, workflows: dict[str, Workflow]) -> None:
        self.db = db
        self.records = RerunRecords(db)
        self.workflows = workflows

    async def original(self, job_id: uuid.UUID, tenant_id: uuid.UUID | None) -> Original:
        """The job to rerun; NotFound when there is none (for this tenant)."""
        found = await self.records.original(job_id, tenant_id)
        if found is None:
            raise NotFound("no such job")
        return found

    def plan(self, original: Original, from_step: str, *,
             replacement: dict[str, Any] | None = None, priority: str | None = None,
             ) -> RerunPlan:
        """The rerun of ``original`` from ``from_step``; ContractError when it cannot be."""
        if original.redacted_at is not None:
            raise ContractError("the job was deleted: its inputs and outputs are gone, so it "
                                "cannot be rerun", code="job_deleted", status=409)
        if original.status not in TERMINAL:
            raise ContractError(
                f"the job is {original.status}: only a job that ended (completed, "
                "dead_letter, cancelled) can be rerun", code="job_not_terminal", status=409)
        workflow = find_workflow(original.workflow, self.workflows)
        try:
            step = workflow.step(from_step)
        except ContractError as exc:
            raise ContractError(exc.message, code="unknown_step", status=422) from None
        index = workflow.steps.index(step)
        earlier = tuple(s.name for s in workflow.steps[:index])
        missing = [name for name in earlier if name not in original.recorded]
        if missing:
            raise ContractError(
                f"step {from_step} starts from the recorded output of {', '.join(missing)}, "
                "which this job does not have (it never finished that step); rerun from an "
                "earlier step", code="step_outputs_missing", status=409)
        data, input_ref = original.input, original.input_ref
        replaced_step: str | None = None
        if replacement is not None:
            if index == 0:
                data, input_ref = workflow.validate_input(replacement), None
            else:
                replaced_step = earlier[-1]
                replacement = _as_output(workflow, replaced_step, replacement)
        priority = priority or original.priority
        deadline = None
        if original.deadline_at is not None:
            # The same time to run as the original had (its deadline has passed, likely).
            deadline = datetime.now(UTC) + (original.deadline_at - original.created_at)
        job = NewJob(
            id=new_id(), tenant_id=original.tenant_id, workflow=workflow.name,
            workflow_version=workflow.version, priority=priority,
            pool=workflow.pool_of(step), step=step.name, max_attempts=step.attempts,
            input=data, input_ref=input_ref, metadata=dict(original.metadata),
            callback_url=original.callback_url, deadline_at=deadline,
            trace_parent=original.trace_parent,
            # An interactive job never waits in the batch lane.
            lane=original.lane if priority == Priority.BULK else ONLINE,
            concurrency_key=original.concurrency_key)
        return RerunPlan(job=job, from_step=step.name, copy_steps=earlier,
                         replaced_step=replaced_step,
                         replacement=replacement if replaced_step else None,
                         rerun_steps=tuple(s.name for s in workflow.steps[index:]))

    async def replay(self, job_id: uuid.UUID, from_step: str, *, tenant_id: uuid.UUID,
                     idempotency: Idempotency) -> Rerun | None:
        """The rerun an ``Idempotency-Key`` made before with the same request (None: a new
        key), answered without planning again, as a keyed submit's repeat is; ContractError
        409 ``idempotency_key_reused`` when the key came with another request."""
        earlier = await self.records.earlier(tenant_id, idempotency)
        if earlier is None:
            return None
        return Rerun(earlier, job_id, from_step, created=False)

    async def write(self, original: Original, plan: RerunPlan, *, by: str | None = None,
                    idempotency: Idempotency | None = None) -> Rerun:
        """Write the planned rerun (one transaction), with its ``Idempotency-Key`` when
        given (a concurrent twin answers the rerun that won); NotFound when the original
        was deleted meanwhile."""
        detail: dict[str, Any] = {"rerun_of": str(original.id), "from_step": plan.from_step}
        if plan.replaced_step is not None or plan.job.input != original.input:
            detail["input_replaced"] = True
        if by:
            detail["by"] = by
        plan = await self._with_children(original, plan)
        written = await self.records.create(
            plan.job, rerun_of=original.id, detail=detail, copy_steps=plan.copy_steps,
            replaced_step=plan.replaced_step, replacement=plan.replacement,
            idempotency=idempotency)
        if written is None:
            raise NotFound("no such job")
        job_id, created = written
        return Rerun(job_id, original.id, plan.from_step, created=created)

    async def _with_children(self, original: Original, plan: RerunPlan) -> RerunPlan:
        """A rerun from the step after one that started children has no children of its
        own: that step's recorded output (a marker the worker resolves by the job's id) is
        copied with the original's children resolved now, as references in input order."""
        if plan.replaced_step is not None or not plan.copy_steps:
            return plan
        previous = plan.copy_steps[-1]
        output = await self.records.step_output(original.id, previous)
        marker = output.get(CHILDREN) if output else None
        if output is None or not isinstance(marker, dict) or marker.get("spawned") is not True:
            return plan
        found = await Children(self.db).outcomes(original.id)
        return replace(plan, replaced_step=previous,
                       replacement={**output, CHILDREN: [c.as_input() for c in found]})

    async def rerun(self, job_id: uuid.UUID, from_step: str, *,
                    tenant_id: uuid.UUID | None = None,
                    replacement: dict[str, Any] | None = None, priority: str | None = None,
                    by: str | None = None) -> Rerun:
        """Rerun the job from ``from_step`` (a tenant's own job when ``tenant_id`` is
        given); raises NotFound or ContractError with the refusal's code."""
        original = await self.original(job_id, tenant_id)
        plan = self.plan(original, from_step, replacement=replacement, priority=priority)
        return await self.write(original, plan, by=by)


def _as_output(workflow: Workflow, step_name: str, replacement: dict[str, Any]
               ) -> dict[str, Any]:
    """The replacement as the recorded output of ``step_name``: held to its output model."""
    try:
        return workflow.step(step_name).check_output(replacement)
    except StepFailure as exc:
        raise ContractError(
            f"input replaces the output of step {step_name} and must fit it: {exc.message}",
            code="invalid_input", status=422) from None
