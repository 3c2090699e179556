"""The job: its id, its statuses, the events of its history, and the legal moves between
statuses.

The state machine lives here, in one table (``MOVES``), so that the data layer, the workers
and the API agree on it. docs/explanation/job-state-machine.md draws the same table.
"""

from __future__ import annotations

import os
import time
import uuid
from enum import StrEnum

__all__ = [
    "MOVES",
    "TERMINAL",
    "EventType",
    "Priority",
    "Status",
    "can_move",
    "new_id",
]


def new_id(at: float | None = None, *, entropy: int | None = None) -> uuid.UUID:
    """A new job id: a version 7 UUID (RFC 9562), its first 48 bits the creation time in
    Unix milliseconds (``at``, seconds; now by default), the other 74 free bits random.

    Time-ordered on purpose. Every index keyed by the job id (jobs' primary key, each
    history partition's (job_id, ...) index) then takes a new job's entries on its
    right-hand pages, which stay in memory however many months of jobs lie to their left;
    with random (version 4) ids each insert and each non-HOT update of a job touched a
    random page of an index that grows with the table (17 blocks per job read from outside
    shared buffers at 3 M jobs). The id is no secret: every read of a job is authorised by
    its tenant, and the job's creation time is in its own record anyway.

    ``entropy`` (80 bits; from os.urandom by default) is for a seeded load of past jobs.
    """
    ms = (time.time_ns() // 1_000_000 if at is None else int(at * 1000)) & (2**48 - 1)
    bits = int.from_bytes(os.urandom(10), "big") if entropy is None else entropy
    value = ms << 80 | bits & (2**80 - 1)
    value = value & ~(0xF << 76) | 0x7 << 76  # version 7
    value = value & ~(0x3 << 62) | 0x2 << 62  # the RFC 9562 variant
    return uuid.UUID(int=value)


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
    # calmq_settle_child (migration 0053): a parent waiting for its children (waiting_reason
    # children) whose join can no longer hold, decided as a child settles
    (Status.QUEUED, Status.DEAD_LETTER),
})


def can_move(current: Status, target: Status) -> bool:
    """Whether a job in ``current`` may move to ``target``."""
    return (current, target) in MOVES
