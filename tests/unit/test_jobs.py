"""The job state machine: terminal statuses are final except a redrive of a dead letter."""

from __future__ import annotations

from calmq.jobs import TERMINAL, Status, can_move


def test_terminal_statuses_have_no_way_out_but_redrive() -> None:
    """completed and cancelled are final; dead_letter may only go back to queued."""
    for status in TERMINAL:
        for target in Status:
            allowed = can_move(status, target)
            assert allowed == (status is Status.DEAD_LETTER and target is Status.QUEUED)


def test_the_happy_path_is_legal() -> None:
    """queued > running > completed is a legal journey."""
    assert can_move(Status.QUEUED, Status.RUNNING)
    assert can_move(Status.RUNNING, Status.COMPLETED)
    assert not can_move(Status.QUEUED, Status.COMPLETED)
