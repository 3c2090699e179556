"""Every re-publish of a job (reaped, swept, released from a hold) keeps its lane."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from calmq.data.jobs import Job, requested


def _job(lane: str, priority: str = "bulk") -> Job:
    return Job(id=uuid.uuid4(), tenant_id=uuid.uuid4(), workflow="summarize",
               workflow_version=1, priority=priority, pool="default", step="summarize",
               attempt=0, max_attempts=3, input={"text": "x"}, input_ref=None, metadata={},
               deadline_at=None, trace_parent=None, created_at=datetime.now(UTC),
               old_status="queued", lane=lane)


def test_a_batch_lane_job_is_requested_on_the_batch_topic() -> None:
    assert requested(_job("batch")).route == "default.batch"


def test_an_online_job_is_requested_on_its_priority_topic() -> None:
    assert requested(_job("online", "interactive")).route == "default.interactive"
    assert requested(_job("online", "bulk")).route == "default.bulk"
