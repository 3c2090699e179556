"""The failure stage: a failed attempt becomes a retry through a tier or a dead letter."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from calmq import topics
from calmq.data import Job
from calmq.errors import FailureClass, StepFailure
from calmq.jobs import EventType, Status
from calmq.processors.failures import FailureStage
from calmq.processors.forwarder import DUE_AT, ORIGIN
from calmq.retrying import Backoff
from calmq.workflows import RetryPolicy, Step, StepContext, StepOutput, Workflow

TIERS = [("5s", 5.0), ("30s", 30.0), ("2m", 120.0)]
TOPIC = "calmq.default.bulk"


class _In(BaseModel):
    text: str


async def _noop(_ctx: StepContext, _data: dict[str, Any]) -> StepOutput:
    return StepOutput({})


def _job(attempt: int = 1, *, max_attempts: int = 3, workflow: str = "none") -> Job:
    return Job(id=uuid.uuid4(), tenant_id=uuid.uuid4(), workflow=workflow, workflow_version=1,
               priority="bulk", pool="default", step="model", attempt=attempt,
               max_attempts=max_attempts, input={"text": "x"}, input_ref=None, metadata={},
               deadline_at=None, trace_parent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
               created_at=datetime.now(UTC), old_status="queued")


def _stage(workflows: dict[str, Workflow] | None = None) -> FailureStage:
    return FailureStage(worker_id="w1", tiers=TIERS, backoff=Backoff(initial=1, maximum=10),
                        workflows=workflows or {})


def _failure(cls: FailureClass = FailureClass.TRANSIENT) -> StepFailure:
    return StepFailure("the provider answered 503", code="provider_unavailable",
                       failure_class=cls)


def test_a_transient_failure_with_attempts_left_is_sent_to_a_retry_tier() -> None:
    """The job becomes retrying and its job.requested goes to calmq.retry.<tier> with the
    origin topic, the due time and the trace as headers."""
    job = _job(attempt=1)
    before = time.time()
    finish = _stage().outcome(job, TOPIC, _failure())
    assert (finish.status, finish.event_type, finish.outcome) == (
        Status.RETRYING, EventType.RETRY_SCHEDULED, "failed")
    assert (finish.job_id, finish.attempt, finish.worker) == (job.id, 1, "w1")
    [entry] = finish.outbox
    assert entry.route == topics.retry_route("5s")
    assert entry.type == "job.requested"
    assert entry.key == str(job.id)
    assert entry.headers[ORIGIN] == TOPIC
    assert entry.headers["traceparent"] == job.trace_parent
    due = int(entry.headers[DUE_AT]) / 1000
    assert before <= due <= time.time() + 1.0  # attempt 1: a delay within [0, 1] s
    assert finish.event_detail["tier"] == "5s"
    assert finish.error == {"code": "provider_unavailable", "class": "transient",
                            "message": "the provider answered 503"}


def test_an_exhausted_budget_is_dead_lettered_with_result_and_dead_letter_events() -> None:
    """The last attempt's failure writes dead_letter with a job.result and a
    job.dead_lettered entry."""
    finish = _stage().outcome(_job(attempt=3, max_attempts=3), TOPIC, _failure())
    assert (finish.status, finish.event_type) == (Status.DEAD_LETTER, EventType.DEAD_LETTERED)
    assert [(e.route, e.type) for e in finish.outbox] == [
        (topics.RESULTS_ROUTE, "job.result"), (topics.DLQ_ROUTE, "job.dead_lettered")]
    assert finish.outbox[0].payload["status"] == Status.DEAD_LETTER
    assert finish.outbox[1].payload["source_topic"] == TOPIC


def test_a_failure_the_step_policy_does_not_retry_is_dead_lettered_at_once() -> None:
    """A step whose retry policy lists the class as non-retryable gets no second attempt."""
    policy = RetryPolicy(max_attempts=5, non_retryable=frozenset({FailureClass.TRANSIENT}))
    wf = Workflow("picky", 1, _In, (Step("model", _noop, retry=policy),))
    finish = _stage({"picky": wf}).outcome(_job(attempt=1, workflow="picky"), TOPIC,
                                           _failure())
    assert finish.status == Status.DEAD_LETTER


def test_the_step_policy_budget_replaces_the_jobs_own() -> None:
    """A step's retry policy with more attempts keeps retrying past the job's budget."""
    wf = Workflow("patient", 1, _In, (Step("model", _noop, retry=RetryPolicy(max_attempts=5)),))
    finish = _stage({"patient": wf}).outcome(
        _job(attempt=3, max_attempts=3, workflow="patient"), TOPIC, _failure())
    assert finish.status == Status.RETRYING


def test_non_transient_failures_are_never_retried() -> None:
    """A verifier failure dead-letters on its first attempt."""
    finish = _stage().outcome(_job(attempt=1), TOPIC, _failure(FailureClass.VERIFIER))
    assert finish.status == Status.DEAD_LETTER


def test_an_infinite_or_huge_retry_after_is_bounded_by_the_longest_tier() -> None:
    """Retry-After inf or 1e300 schedules a retry through the longest tier, due within it."""
    for retry_after in (float("inf"), 1e300, 10_000.0):
        failure = StepFailure("429", code="rate_limited", failure_class=FailureClass.TRANSIENT,
                              retry_after=retry_after)
        before = time.time()
        finish = _stage().outcome(_job(attempt=1), TOPIC, failure)
        assert finish.status == Status.RETRYING
        assert finish.event_detail["tier"] == "2m"
        assert finish.event_detail["delay_seconds"] == 120.0
        [entry] = finish.outbox
        due = int(dict(entry.headers)[DUE_AT]) / 1000
        assert before + 119 <= due <= time.time() + 121
