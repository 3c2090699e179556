"""insert_jobs' array (calmq.data.jobs): each row is the job's fields by name, ids as text and
times in ISO 8601, with its job.requested outbox entry, as jsonb_to_recordset reads them."""

from __future__ import annotations

import json
import uuid
from dataclasses import fields
from datetime import UTC, datetime

import pytest

from calmq.data import NewJob
from calmq.data.jobs import _dump_rows, _row, requested


def test_a_row_is_every_field_as_json_and_its_outbox_entry() -> None:
    deadline = datetime(2026, 12, 8, 1, 2, 3, 456789, tzinfo=UTC)
    job = NewJob(id=uuid.uuid4(), tenant_id=uuid.uuid4(), workflow="summarize",
                 workflow_version=1, priority="bulk", pool="default", step="summarize",
                 max_attempts=3, input={"text": "caf\u00e9", "n": [1, 2.5]},
                 metadata={"backfill": "x"}, deadline_at=deadline,
                 trace_parent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    [row] = json.loads(_dump_rows([_row(job)]))
    expected = {f.name: getattr(job, f.name) for f in fields(NewJob)}
    expected.update(id=str(job.id), tenant_id=str(job.tenant_id),
                    deadline_at=deadline.isoformat())
    out = requested(job)
    assert {k: v for k, v in row.items() if k in expected} == expected
    assert row["route"] == out.route == "default.bulk"
    assert row["headers"] == {"traceparent": job.trace_parent}
    assert row["event_id"] == row["payload"]["event_id"]
    assert row["payload"]["job_id"] == str(job.id)
    assert set(row) == set(expected) | {"event_id", "route", "payload", "headers"}


def test_a_value_json_cannot_hold_is_refused() -> None:
    with pytest.raises(TypeError):
        _dump_rows([{"x": object()}])
