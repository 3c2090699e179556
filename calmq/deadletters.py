"""Dead letters: review them, and redrive them once their cause is fixed.

A dead letter is a job whose status is ``dead_letter``: its record already holds what a
person needs to decide (input, every attempt and its error, the history, the last output).
A redrive is one transaction: the job goes back to ``queued`` with a fresh attempt budget,
its earlier attempts move to ``job_attempts_redriven`` (kept, numbered by round), the
history gets a ``redriven`` event naming who and why, and a ``job.requested`` goes to the
work route through the outbox. The update is guarded by ``status = 'dead_letter'``, so a
job that is not (or no longer) a dead letter is never run twice.

Before redriving, the input is validated again against today's version of its workflow:
the fix for a dead letter is often a new workflow version, and a job whose input no longer
fits would only die again.

Messages that never became a job (unreadable bytes on a work topic) are on the
``calmq.dlq`` topic only; they have no record to redrive.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from calmq.data import Database
from calmq.data.deadletters import DeadJob, DeadLetter, DeadLetterGroup, DeadLetterRecords
from calmq.errors import ContractError, NotFound
from calmq.jobs import Status
from calmq.objects import ObjectStore
from calmq.workflows import Workflow, builtin_workflows
from calmq.workflows.progress import ChildLimits

__all__ = ["DeadLetterFilter", "DeadLetters", "RedriveOutcome"]

_CLASSES = frozenset({"transient", "input", "permission", "policy", "verifier", "deadline", "bug"})


@dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters to list or redrive; ``None`` fields do not filter."""

    failure_class: str | None = None
    code: str | None = None
    workflow: str | None = None
    tenant: str | None = None  # tenant name (operators)
    tenant_id: uuid.UUID | None = None  # tenant id (the API scopes every call by it)
    since: datetime | None = None  # dead-lettered at or after
    until: datetime | None = None  # dead-lettered before
    limit: int = 100

    def __post_init__(self) -> None:
        if self.failure_class is not None and self.failure_class not in _CLASSES:
            raise ContractError(
                f"unknown failure class {self.failure_class!r}; "
                f"one of {', '.join(sorted(_CLASSES))}",
                code="invalid_filter", status=422,
            )
        if not 1 <= self.limit <= 10_000:
            raise ContractError("limit must be between 1 and 10000", code="invalid_filter",
                                status=422)

    def params(self) -> dict[str, Any]:
        return {
            "failure_class": self.failure_class, "code": self.code, "workflow": self.workflow,
            "tenant": self.tenant, "tenant_id": self.tenant_id, "since": self.since,
            "until": self.until, "limit": self.limit,
        }


Outcome = Literal["redriven", "would_redrive", "skipped", "rejected"]


@dataclass(frozen=True)
class RedriveOutcome:
    """What a redrive did to one job: ``redriven`` (or ``would_redrive`` on a dry run),
    ``skipped`` (not a dead letter: nothing written) or ``rejected`` (cannot run again as
    it is; ``code`` says why)."""

    job_id: uuid.UUID
    outcome: Outcome
    code: str | None = None
    message: str = ""
    round: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": str(self.job_id), "outcome": self.outcome, "code": self.code,
                "message": self.message, "round": self.round}


@dataclass(frozen=True, slots=True)
class _Plan:
    """How a redriven job runs: today's workflow version, its step's pool and budget."""

    workflow_version: int
    pool: str
    max_attempts: int


class DeadLetters:
    """Review and redrive operations on the store's dead-lettered jobs."""

    def __init__(
        self,
        db: Database,
        *,
        workflows: dict[str, Workflow] | None = None,
        objects: ObjectStore | None = None,
        children_in_flight: int = ChildLimits.in_flight,
    ) -> None:
        # children_in_flight: setting children_in_flight_max, which a redriven parent's
        # failed children wait for as a spawn's do
        self.records = DeadLetterRecords(db, children_in_flight=children_in_flight)
        self.workflows = workflows if workflows is not None else builtin_workflows()
        self.objects = objects  # None: inputs by reference are not re-read before a redrive

    async def find(self, where: DeadLetterFilter | None = None, *,
                   after: tuple[datetime, uuid.UUID] | None = None) -> list[DeadLetter]:
        """Dead-lettered jobs matching ``where``, oldest death first; ``after`` (the
        dead_lettered_at and id of a previous page's last row) starts past that page."""
        return await self.records.find((where or DeadLetterFilter()).params(), after)

    async def count(self, where: DeadLetterFilter | None = None, *,
                    after: tuple[datetime, uuid.UUID] | None = None) -> int:
        """How many dead letters match ``where`` (past ``after``), whatever its limit."""
        return await self.records.count((where or DeadLetterFilter()).params(), after)

    async def summary(self, where: DeadLetterFilter | None = None) -> list[DeadLetterGroup]:
        """Matching dead letters grouped by workflow/step, failure class and code."""
        return await self.records.summary((where or DeadLetterFilter()).params())

    async def show(self, job_id: uuid.UUID, tenant_id: uuid.UUID | None = None) -> dict[str, Any]:
        """The whole record of a job: row, attempts of every round, history, last output.

        Works for a job in any status, so that a person can see why it is not (or no
        longer) a dead letter. Raises NotFound for an unknown job (or another tenant's).
        """
        job: dict[str, Any] | None = await self.records.record(job_id, tenant_id)
        if job is None:
            raise NotFound(f"no job {job_id}")
        job["last_output"] = _last_output(job)
        return job

    async def redrive(
        self,
        job_ids: list[uuid.UUID],
        *,
        by: str,
        reason: str,
        tenant_id: uuid.UUID | None = None,
        dry_run: bool = False,
        rate: float | None = None,
        note: str | None = None,
    ) -> list[RedriveOutcome]:
        """Redrive each job in its own transaction, at most ``rate`` jobs per second.

        One transaction per job keeps a job that cannot run again from holding back the
        others, and lets ``rate`` spread a large redrive so the fleet is not flooded.
        """
        if not by.strip() or not reason.strip():
            raise ContractError("a redrive needs who (by) and why (reason)",
                                code="redrive_needs_reason", status=422)
        if rate is not None and rate <= 0:
            raise ContractError("rate must be a positive number of jobs per second",
                                code="invalid_rate", status=422)
        loop = asyncio.get_running_loop()
        started = loop.time()
        outcomes = []
        for n, job_id in enumerate(job_ids):
            if rate is not None and not dry_run:
                # Pace against the start, not the previous job, so slow ones do not add up.
                await asyncio.sleep(max(0.0, started + n / rate - loop.time()))
            outcomes.append(await self._redrive_one(job_id, by=by, reason=reason, note=note,
                                                    tenant_id=tenant_id, dry_run=dry_run))
        return outcomes

    async def _redrive_one(
        self, job_id: uuid.UUID, *, by: str, reason: str, tenant_id: uuid.UUID | None,
        dry_run: bool, note: str | None = None,
    ) -> RedriveOutcome:
        job = await self.records.job(job_id, tenant_id)
        if job is None:
            raise NotFound(f"no job {job_id}")
        if job.status != Status.DEAD_LETTER:
            return RedriveOutcome(job_id, "skipped", "not_dead_lettered",
                                  f"the job is {job.status}, not a dead letter")
        try:
            workflow, plan = await self._plan(job)
        except ContractError as exc:
            return RedriveOutcome(job_id, "rejected", exc.code, exc.message)
        if dry_run:
            return RedriveOutcome(job_id, "would_redrive", None,
                                  f"would requeue at step {job.step} of {workflow.name} "
                                  f"v{workflow.version} with {plan.max_attempts} attempts")
        detail = {"by": by, "reason": reason[:1000], "previous_error": job.error,
                  "workflow_version": workflow.version}
        if note:  # what the caller said about who they are: kept, but ``by`` is the audit field
            detail["by_note"] = note[:200]
        try:
            moved = await self.records.requeue(job_id, detail=detail,
                                               workflow_version=plan.workflow_version,
                                               pool=plan.pool, max_attempts=plan.max_attempts)
        except ContractError as exc:  # a parent whose join can no longer hold (children)
            return RedriveOutcome(job_id, "rejected", exc.code, exc.message)
        if moved is None:  # someone else redrove (or cancelled) it since we read it
            return RedriveOutcome(job_id, "skipped", "not_dead_lettered",
                                  "the job stopped being a dead letter during the redrive")
        return RedriveOutcome(job_id, "redriven", None,
                              f"requeued at step {moved.step} with {plan.max_attempts} "
                              "attempts", round=moved.round)

    async def _plan(self, job: DeadJob) -> tuple[Workflow, _Plan]:
        """Today's workflow, step and budget for the job; ContractError if it cannot run."""
        workflow = self.workflows.get(job.workflow)
        if workflow is None:
            raise ContractError(f"no workflow named {job.workflow!r} exists today",
                                code="unknown_workflow", status=422)
        step = workflow.step(job.step)  # ContractError unknown_step if it was removed
        deadline = job.deadline_at
        if deadline is not None and deadline <= datetime.now(deadline.tzinfo):
            raise ContractError(
                f"the job's deadline passed at {deadline.isoformat()}; submit it again instead",
                code="deadline_passed", status=409)
        if job.input is not None:
            workflow.validate_input(job.input)
        elif job.input_ref and self.objects is not None:
            raw = await self.objects.get(job.input_ref)
            try:
                data = json.loads(raw)
            except ValueError:
                data = {"text": raw.decode("utf-8", "replace")}
            workflow.validate_input(data if isinstance(data, dict) else {"text": str(data)})
        return workflow, _Plan(workflow.version, step.pool or workflow.pool, step.max_attempts)


def _last_output(job: dict[str, Any]) -> Any:
    """The artifact if there is one, else the newest output the history carries (review)."""
    if job.get("artifact") is not None:
        return job["artifact"]
    for event in reversed(job["events"]):
        detail = event["detail"] or {}
        if isinstance(detail, dict) and "output" in detail:
            return detail["output"]
    return None
