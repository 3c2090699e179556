"""Failure handling as one stage: "this attempt failed with X" -> the job's next move.

The runner only classifies what went wrong (a ``StepFailure``); this stage picks the retry
budget and backoff (the step's own retry policy, else the job's budget and the worker's
backoff), asks the policy (``policy.decide``) and builds the outcome the group committer
writes:

- retry: the job becomes ``retrying`` (``retry_scheduled``) and its ``job.requested`` goes to
  ``calmq.retry.<tier>`` with the topic it came from and the time it is due as headers, where
  the forwarder holds it until then;
- dead letter: the job becomes ``dead_letter`` (``dead_lettered``) with a ``job.result`` and a
  ``job.dead_lettered`` event.

Both in the outcome's one transaction, so a crash never leaves a failed job without its next
event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from functools import cache
from typing import Any

from prometheus_client import Counter

from calmq import events, topics
from calmq.data import Finish, Job, Store, outbox
from calmq.data.providers import ProviderLedger
from calmq.errors import StepFailure
from calmq.failure_codes import ProviderBlocked, WaitUncounted, spec
from calmq.jobs import EventType, Status
from calmq.processors import metrics
from calmq.processors.forwarder import DUE_AT, ORIGIN
from calmq.processors.policy import decide
from calmq.retrying import Backoff
from calmq.workflows import Workflow

__all__ = ["FailureStage", "hand_back_blocked", "hand_back_waiting"]

log = logging.getLogger(__name__)


@cache
def _handbacks() -> Counter:
    return Counter("calmq_provider_handbacks_total", "Attempts handed back uncounted because "
                   "their provider and model were blocked fleet-wide", ["code"])


async def hand_back_blocked(store: Store, job: Job, worker_id: str,
                            blocked: ProviderBlocked) -> bool:
    """An attempt that met a blocked provider (calmq.calls.gate) is not the job's attempt:
    the job goes back to ``queued`` at its previous attempt, its attempt row removed (none
    is counted), waiting with ``waiting_reason`` ``provider_blocked`` until the block lifts
    and the release re-publishes it. Nothing is dead-lettered. The event says whether the
    job's own call met the refusal (``met``): such a hand-back is the job's only one
    (processors/attempt.py). False when the attempt no longer held the job (another attempt
    has it now)."""
    moved = await ProviderLedger(store).hand_back(
        job.id, job.lease_version, worker_id,
        {"code": blocked.code, "provider": blocked.provider.split(":", 1)[0],
         "model": blocked.model, "met": blocked.met})
    if moved:
        _handbacks().labels(blocked.code).inc()
    else:
        log.info("the hand-back of %s found it held by another attempt", job.id)
    return moved


async def hand_back_waiting(store: Store, job: Job, worker_id: str,
                            waiting: WaitUncounted) -> bool:
    """An attempt that made no call because what it needs had no room yet (every allowed
    model cooling down, calmq.calls.fallback; its key's rate limit, calmq.calls.key_rates) is
    not the job's attempt: the job goes back to ``queued`` at its previous attempt, its attempt row
    removed, waiting (``waiting_reason``: the refusal's) until ``seconds`` have passed and
    the release pass re-publishes it. False when the attempt no longer held the job."""
    moved = await ProviderLedger(store).hand_back(
        job.id, job.lease_version, worker_id, waiting.detail, reason=waiting.reason,
        wait_seconds=waiting.seconds)
    if moved:
        metrics.WAITED_UNCOUNTED.labels(waiting.reason).inc()
    return moved


class FailureStage:
    def __init__(self, *, worker_id: str, tiers: list[tuple[str, float]], backoff: Backoff,
                 workflows: Mapping[str, Workflow], max_attempts: int | None = None) -> None:
        self.worker_id = worker_id
        self.tiers = tiers
        self.backoff = backoff
        self.workflows = workflows
        self.max_attempts = max_attempts  # overrides every job's and step's own budget

    def outcome(self, job: Job, topic: str, failure: StepFailure) -> Finish:
        """The outcome of ``job``'s attempt that failed with ``failure``; ``topic``: where the
        attempt's message came from (a retry goes back there)."""
        error = {"code": failure.code, "class": failure.failure_class.value,
                 "message": failure.message[:1000]}
        # Retried or not as the failure-code registry says (calmq.failure_codes).
        if spec(failure.code, failure.failure_class).retried != failure.retryable:
            log.error("failure code %s: class %s disagrees with the registry", failure.code,
                      failure.failure_class.value)
        budget, backoff = self._budget(job, failure)
        decision = decide(failure, job.attempt, budget, self.tiers, backoff)
        if decision.retry:
            assert decision.tier is not None
            due = int((time.time() + decision.delay) * 1000)
            headers = {ORIGIN: topic, DUE_AT: str(due)}
            metrics.RETRIES.labels(failure.failure_class.value, decision.tier).inc()
            metrics.RETRY_DELAY.labels(failure.failure_class.value).observe(decision.delay)
            return self._finish(
                job, status=Status.RETRYING, event_type=EventType.RETRY_SCHEDULED,
                error=error,
                event_detail={**error, "delay_seconds": round(decision.delay, 3),
                              "tier": decision.tier},
                outbox=[outbox.entry(topics.retry_route(decision.tier), "job.requested",
                                     events.requested(job), key=job.id,
                                     trace_parent=job.trace_parent, headers=headers)],
            )
        result = events.result(job, Status.DEAD_LETTER, error=error)
        dead = events.dead_lettered(job, last_event=EventType.DEAD_LETTERED,
                                    source_topic=topic)
        metrics.DEAD_LETTERS.labels(failure.failure_class.value).inc()
        return self._finish(
            job, status=Status.DEAD_LETTER, event_type=EventType.DEAD_LETTERED,
            error=error, event_detail=error,
            outbox=[outbox.entry(topics.RESULTS_ROUTE, "job.result", result, key=job.id,
                                 trace_parent=job.trace_parent),
                    outbox.entry(topics.DLQ_ROUTE, "job.dead_lettered", dead, key=job.id,
                                 trace_parent=job.trace_parent)],
        )

    def _budget(self, job: Job, failure: StepFailure) -> tuple[int, Backoff]:
        """The attempts ``job`` may use and the backoff between them: its step's own retry
        policy when the step has one (a failure it does not retry gets no more attempts)."""
        workflow = self.workflows.get(job.workflow)
        policy = workflow.step(job.step).retry if workflow and job.step in {
            s.name for s in workflow.steps} else None
        if policy is None:
            return self.max_attempts or job.max_attempts, self.backoff
        if not policy.retries(failure):
            return 0, self.backoff
        return (self.max_attempts or policy.max_attempts,
                Backoff(policy.initial_seconds, policy.maximum_seconds, policy.multiplier))

    def _finish(self, job: Job, **outcome: Any) -> Finish:
        return Finish(job_id=job.id, worker=self.worker_id, step=job.step,
                      attempt=job.attempt, lease_version=job.lease_version, outcome="failed",
                      **outcome)
