"""The job: its statuses, the events of its history, and the legal moves between statuses.

The state machine lives here, in one table, so that the store, the workers and the API
agree on it. docs/explanation/job-state-machine.md draws the same table.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
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
    REVIEW_REQUESTED = "review_requested"
    REVIEWED = "reviewed"
    COMPLETED = "completed"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"
    REDRIVEN = "redriven"


_MOVES: dict[Status, frozenset[Status]] = {
    Status.QUEUED: frozenset({Status.RUNNING, Status.CANCELLED, Status.DEAD_LETTER}),
    Status.RUNNING: frozenset(
        {
            Status.COMPLETED,
            Status.RETRYING,
            Status.DEAD_LETTER,
            Status.AWAITING_REVIEW,
            Status.CANCELLED,
            Status.QUEUED,  # lease expired: the reaper requeues it
            Status.RUNNING,  # next step of a multi-step workflow
        }
    ),
    Status.RETRYING: frozenset({Status.RUNNING, Status.CANCELLED, Status.DEAD_LETTER}),
    Status.AWAITING_REVIEW: frozenset(
        {Status.QUEUED, Status.COMPLETED, Status.DEAD_LETTER, Status.CANCELLED}
    ),
    Status.COMPLETED: frozenset(),
    Status.DEAD_LETTER: frozenset({Status.QUEUED}),  # redrive
    Status.CANCELLED: frozenset(),
}


def can_move(current: Status, target: Status) -> bool:
    """Whether a job in ``current`` may move to ``target``."""
    return target in _MOVES[current]
