"""A callback's body: the Standard Webhooks shape by default, calmq's first behind a setting."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from calmq.producers.webhooks import webhook_body
from calmq.settings import Settings

AT = datetime(2026, 12, 7, 6, 40, 0, 112318, tzinfo=UTC)
JOB = {"job_id": "j1", "status": "completed"}


def test_version_2_is_type_timestamp_and_data_and_the_default() -> None:
    """Payload version 2 (the default) is {type: job.<event>, timestamp, data: the job}."""
    assert Settings().webhook_payload_version == 2
    body = json.loads(webhook_body(Settings().webhook_payload_version, "completed", AT, JOB))
    assert body == {"type": "job.completed", "timestamp": "2026-12-07T06:40:00.112318+00:00",
                    "data": JOB}


def test_version_1_is_the_first_event_and_job_body() -> None:
    """Payload version 1 keeps calmq's first body, {event, job}, byte for byte compact."""
    body = webhook_body(1, "dead_lettered", AT, JOB)
    assert body == b'{"event":"dead_lettered","job":{"job_id":"j1","status":"completed"}}'
