"""The data layer's records line up with the SQL and the Avro schema they are read from."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path

from calmq import events, sql
from calmq.codec import SchemaStore, SingleObjectCodec
from calmq.data import Database, Job, NewJob, outbox
from calmq.data.tenants import hash_key, key_prefix, new_key

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
CREATED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _job(**kw: object) -> Job:
    values: dict[str, object] = {
        "id": uuid.uuid4(), "tenant_id": uuid.uuid4(), "workflow": "summarize",
        "workflow_version": 2, "priority": "bulk", "pool": "default", "step": "summarize",
        "attempt": 1, "max_attempts": 3, "input": {"text": "x"}, "input_ref": None,
        "metadata": {}, "deadline_at": None, "trace_parent": None, "created_at": CREATED,
        "old_status": "queued", **kw}
    return Job.from_row(values)


def _newest_fields(event: str) -> list[str]:
    newest = max((SCHEMAS / event).glob("v*.avsc"), key=lambda p: int(p.stem[1:]))
    return [f["name"] for f in json.loads(newest.read_text("utf-8"))["fields"]]


def test_job_requested_is_every_schema_field_of_the_record() -> None:
    """job.requested holds exactly the Avro schema's fields, read from the Job by name."""
    job = _job(deadline_at=CREATED, trace_parent="00-abc-def-01")
    event = events.requested(job)
    assert list(event) == _newest_fields("job_requested")
    assert event["job_id"] == str(job.id)
    assert event["tenant_id"] == str(job.tenant_id)
    assert event["workflow_version"] == 2
    assert event["created_at"] == event["deadline_at"] == int(CREATED.timestamp() * 1000)
    assert event["trace_parent"] == "00-abc-def-01"


def test_job_requested_of_a_new_job_encodes_with_the_schema() -> None:
    """A new job's job.requested (attempt 0, no created_at yet) is a valid Avro record."""
    job = NewJob(id=uuid.uuid4(), tenant_id=uuid.uuid4(), workflow="summarize",
                 workflow_version=1, priority="interactive", pool="default", step="summarize",
                 max_attempts=3, input={"text": "x"})
    event = events.requested(job)
    assert event["attempt"] == 0
    assert isinstance(event["created_at"], int)
    codec = SingleObjectCodec(SchemaStore(SCHEMAS))
    assert str(codec.decode(codec.encode("job.requested", event))[1]["job_id"]) == str(job.id)


def test_insert_job_writes_every_new_job_field() -> None:
    """Each NewJob field is a parameter of insert_job and a column of insert_jobs' rows."""
    q = Database("postgresql://unused").q
    for name in (f.name for f in fields(NewJob)):
        assert f"%({name})s" in q["insert_job"], name
        assert re.search(rf"\b{name} \w+", q["insert_jobs"]), name


def test_the_job_row_fragment_is_the_job_fields() -> None:
    """The job_row fragment names every Job field but old_status, each statement's own."""
    columns = [c.strip().removeprefix("j.") for c in sql.fragments()["job_row"].split(",")]
    assert sorted(columns) == sorted(f.name for f in fields(Job) if f.name != "old_status")


def test_every_statement_returning_jobs_uses_the_job_row_fragment() -> None:
    """A statement whose rows carry old_status (they are read as Job) takes its other
    columns from the job_row fragment instead of a list of its own."""
    returning = [name for name, (kind, text) in sql.sources().items()
                 if kind == "name" and "old_status" in text]
    assert len(returning) >= 8
    for name in returning:
        assert "{{job_row}}" in sql.sources()[name][1], name


def test_every_requeue_returns_the_whole_job_row() -> None:
    """A redrive and a resumed review return the whole row, so their job.requested (filled
    by the schema's field names) carries a new column with no edit to their SQL."""
    q = Database("postgresql://unused").q
    for name in ("dlq_requeue", "wf_review_resume"):
        returning = re.findall(r"RETURNING (.*?)(?:\n\)|;)", q[name], re.DOTALL)[0]
        assert returning.strip() == "*", name


def test_an_outbox_entry_carries_the_event_id_key_and_trace() -> None:
    """entry() takes its id from the event, keys by the job and adds the traceparent."""
    job = _job(trace_parent="00-abc-def-01")
    payload = events.result(job, "completed")
    made = outbox.entry("results", "job.result", payload, key=job.id,
                        trace_parent=job.trace_parent, headers={"x": "1"})
    assert (made.id, made.key) == (payload["event_id"], str(job.id))
    assert made.headers == {"x": "1", "traceparent": "00-abc-def-01"}
    assert outbox.entry("results", "job.result", payload, key=job.id).headers == {}


def test_api_keys_are_stored_as_hash_and_prefix() -> None:
    """A key is cq_ and random; what is stored is its SHA-256 and its first 12 characters."""
    key = new_key()
    assert key.startswith("cq_")
    assert len(key) > 40
    assert key != new_key()
    assert hash_key(key) == hashlib.sha256(key.encode()).digest()
    assert key_prefix(key) == key[:12]
