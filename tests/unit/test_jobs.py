"""The job state machine: terminal statuses are final except a redrive of a dead letter; and
the job id, a time-ordered version 7 UUID."""

from __future__ import annotations

import time
import uuid

from calmq.jobs import TERMINAL, Status, can_move, new_id


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


def test_a_job_id_is_a_version_7_uuid_of_its_creation_time() -> None:
    """RFC 9562 version 7: the version and variant bits, the first 48 bits the creation time
    in Unix milliseconds, and the rest differing between ids of the same millisecond."""
    at = 1_796_300_000.123
    ids = [new_id(at) for _ in range(1000)]
    assert len(set(ids)) == 1000
    for job_id in ids:
        assert job_id.version == 7
        assert job_id.variant == uuid.RFC_4122
        assert job_id.int >> 80 == 1_796_300_000_123
        assert uuid.UUID(str(job_id)) == job_id


def test_job_ids_sort_by_creation_time() -> None:
    """An id made later sorts after one made earlier (the order that keeps new jobs' index
    entries together), also as text, the form Kafka keys and URLs carry."""
    earlier = new_id(time.time() - 1)
    later = new_id()
    assert earlier < later
    assert str(earlier) < str(later)
    seeded = new_id(1_796_300_000.0, entropy=2**80 - 1)
    assert seeded.int >> 80 == 1_796_300_000_000
    assert seeded == new_id(1_796_300_000.0, entropy=2**80 - 1)
