"""The job: its statuses, the events of its history, and the legal moves between statuses.

The state machine lives here, in one table (``MOVES``), so that the data layer, the workers
and the API agree on it. docs/explanation/job-state-machine.md draws the same table.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "MOVES",
    "TERMINAL",
    "EventType",
    "Priority",
    "Status",
    "can_move",
]


class Status(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    AWAITING_REVIEW = "awaiting_review"
    COMPLETED = "completed"
    DEAD_LETTER = "dead_letter"
    CANCELLED = "cancelled"


TERMINAL = frozenset({Status.COMPLETED, Status.DEAD_LETTER, Status.CANCELLED})


class Priority(StrEnum):
    INTERACTIVE = "interactive"
    BULK = "bulk"


class EventType(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    RETRY_SCHEDULED = "retry_scheduled"
    REQUEUED_AFTER_RESTART = "requeued_after_restart"
    REQUEUED_BY_SWEEPER = "requeued_by_sweeper"
    REVIEW_REQUESTED = "review_requested"
    REVIEWED = "reviewed"
    COMPLETED = "completed"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"
    REDRIVEN = "redriven"
    # Held in queued, detail.reason says for what: a spend cap or a tenant's token quota
    # (calmq.spending), a pool's review cap (calmq.data.review_caps); resumed: re-published.
    WAITING = "waiting"
    RESUMED = "resumed"


# Every legal move, declared once, with the statement that makes it. The SQL guards of
# those statements (calmq/sql) must agree: tests/integration/test_job_moves.py runs each
# guarded statement from every status and compares what moved with this table.
MOVES: frozenset[tuple[Status, Status]] = frozenset({
    (Status.QUEUED, Status.RUNNING),  # claim_jobs
    (Status.RETRYING, Status.RUNNING),  # claim_jobs: the forwarder re-sent it when due
    (Status.RUNNING, Status.RUNNING),  # claim_jobs: its lease expired, another worker takes it
    (Status.RUNNING, Status.COMPLETED),  # finish_attempts
    (Status.RUNNING, Status.RETRYING),  # finish_attempts: transient failure, attempts left
    (Status.RUNNING, Status.DEAD_LETTER),  # finish_attempts; poison_expired_leases: the cap
    (Status.RUNNING, Status.AWAITING_REVIEW),  # finish_attempts: confidence below threshold
    (Status.RUNNING, Status.QUEUED),  # finish_attempts (next step), reap_expired_leases,
    # provider_hand_back (its provider is blocked: the attempt is not counted)
    (Status.AWAITING_REVIEW, Status.QUEUED),  # wf_review_resume: approved, next step
    (Status.AWAITING_REVIEW, Status.COMPLETED),  # wf_review_complete: approved, last step
    (Status.AWAITING_REVIEW, Status.DEAD_LETTER),  # wf_review_dead_letter: rejected, expired
    (Status.QUEUED, Status.CANCELLED),  # cancel_job
    (Status.RUNNING, Status.CANCELLED),  # cancel_job: the worker aborts at its next heartbeat
    (Status.RETRYING, Status.CANCELLED),  # cancel_job
    (Status.AWAITING_REVIEW, Status.CANCELLED),  # cancel_job
    (Status.DEAD_LETTER, Status.QUEUED),  # dlq_requeue: redrive, fresh attempt budget
})


def can_move(current: Status, target: Status) -> bool:
    """Whether a job in ``current`` may move to ``target``."""
    return (current, target) in MOVES
