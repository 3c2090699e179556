"""Size discipline through the real stack: a tenant's oversized field is refused at intake,
and an outbox row too large for Kafka goes to calmq.dlq as a truncated record while the
relay goes on publishing every other tenant's rows (issue 27)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg.types.json import Jsonb

from calmq import events, topics
from calmq.codec import make_codec
from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.relay import INSERT, TopicReader, event_payload
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

BOUNDARY = "limitsboundary"


@pytest.fixture(scope="module")
def api(stack: StackState) -> Api:
    return Api(stack.env["CALMQ_API_URL"],
               create_tenant(stack.env["CALMQ_DATABASE_URL"], f"limits-{uuid.uuid4().hex[:8]}"))


@pytest.fixture
def dlq(stack: StackState) -> Iterator[TopicReader]:
    reader = TopicReader(stack.env["CALMQ_KAFKA_BOOTSTRAP"], topics.DLQ)
    yield reader
    reader.close()


def _big_metadata() -> dict[str, str]:
    """600 kB of UTF-8 (two bytes a character), 1.8 MB as the events would escape it."""
    return {"note": "é" * 300_000}


def test_600_kb_non_ascii_metadata_is_refused_at_intake(api: Api) -> None:
    """A JSON submit whose metadata is 600 kB of UTF-8 answers 413 metadata_too_large."""
    body = json.dumps({"workflow": "summarize", "input": {"text": "hi"},
                       "metadata": _big_metadata()}, ensure_ascii=False).encode()
    assert 600_000 <= len(body) < 1024 * 1024  # under the body limit: metadata's own limit
    status, _h, problem = api.call("POST", "/v1/jobs", raw=body)
    assert status == 413, problem
    assert problem["code"] == "metadata_too_large"
    assert "max_metadata_bytes" in problem["detail"]


def test_600_kb_non_ascii_metadata_is_refused_in_a_multipart_submit(api: Api) -> None:
    """A multipart submit's metadata field is held to the same limit."""
    parts = [("workflow", "summarize"),
             ("metadata", json.dumps(_big_metadata(), ensure_ascii=False))]
    raw = b"".join(
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{n}"\r\n\r\n{v}\r\n'.encode()
        for n, v in parts)
    raw += (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="a.txt"\r\nContent-Type: text/plain\r\n\r\nhello\r\n'
            f"--{BOUNDARY}--\r\n").encode()
    status, _h, problem = api.call(
        "POST", "/v1/jobs", raw=raw,
        headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert status == 413, problem
    assert problem["code"] == "metadata_too_large"


def _dead_letter(stack: StackState, dlq: TopicReader, job: str) -> tuple[dict[str, str],
                                                                         dict[str, object]]:
    found = wait_for(lambda: dlq.poll() is not None and [
        r for r in dlq.records if r.key == job], timeout=60,
        what=f"the rejection of job {job} on calmq.dlq")
    [record] = found
    event_type, event = make_codec(stack.env["CALMQ_SCHEMA_REGISTRY_URL"]).decode(record.value)
    assert event_type == "job.dead_lettered"
    return record.headers, event


def test_an_outbox_row_too_large_for_kafka_goes_to_the_dlq_and_others_still_complete(
    stack: StackState, dlq: TopicReader
) -> None:
    """A job.result row larger than the relay producer's message.max.bytes (written directly,
    as an older client would) reaches calmq.dlq as a truncated record naming its job; a
    second tenant's job submitted after it completes."""
    job = str(uuid.uuid4())
    payload = events.result({"id": job, "tenant_id": str(uuid.uuid4()), "workflow": "summarize",
                             "step": "summarize", "attempt": 1,
                             "metadata": {"blob": "x" * 1_500_000}}, "completed")
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute(INSERT, (payload["event_id"], topics.RESULTS_ROUTE, job, "job.result",
                              Jsonb(payload), Jsonb({})))
    other = Api(stack.env["CALMQ_API_URL"],
                create_tenant(stack.env["CALMQ_DATABASE_URL"], f"other-{uuid.uuid4().hex[:8]}"))
    other_job = other.submit({"text": "submitted after the oversized row", "mode": "success"})
    done = wait_for(lambda: (j := other.job(other_job))["status"] in
                    ("completed", "dead_letter") and j, timeout=90,
                    what="the other tenant's job to finish")
    assert done["status"] == "completed"
    headers, event = _dead_letter(stack, dlq, job)
    assert headers["calmq-error-code"] == "record_too_large"
    assert headers["id"] == payload["event_id"]
    assert event["job_id"] == job
    assert event["last_event"] == "job.result"
    raw = event["raw_value"]
    assert isinstance(raw, bytes)
    assert 0 < len(raw) <= 8 * 1024
    errors = event["errors"]
    assert isinstance(errors, list)
    assert errors[0]["code"] == "record_too_large"


def test_a_record_the_broker_refuses_as_too_large_goes_to_the_dlq(
    stack: StackState, dlq: TopicReader
) -> None:
    """A row within the producer's limit but over its topic's max.message.bytes is refused by
    the broker; the relay rejects it to calmq.dlq and publishes the rows around it. Written in
    one transaction, they reach the producer together and travel in one batch, which the broker
    refuses as a whole: only the large row is the one at fault."""
    route = f"limits_{uuid.uuid4().hex[:10]}"
    topic = f"calmq.{route}"
    admin = AdminClient({"bootstrap.servers": stack.env["CALMQ_KAFKA_BOOTSTRAP"]})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1,
                                  config={"max.message.bytes": "100000"})])[topic].result()
    big_job = str(uuid.uuid4())
    big = {**event_payload(big_job, 0), "input_ref": "s3://b/" + "k" * 300_000}
    before = [event_payload(str(uuid.uuid4()), 0) for _ in range(10)]
    after = [event_payload(str(uuid.uuid4()), 0) for _ in range(10)]
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        for body in (*before, big, *after):
            conn.execute(INSERT, (body["event_id"], route, body["job_id"], "job.requested",
                                  Jsonb(body), Jsonb({})))
    work = TopicReader(stack.env["CALMQ_KAFKA_BOOTSTRAP"], topic)
    try:
        work.wait_ids({str(b["event_id"]) for b in (*before, *after)}, timeout=60)
        headers, event = _dead_letter(stack, dlq, big_job)
        assert headers["calmq-error-code"] == "record_too_large"
        assert event["source_topic"] == topic
        assert str(big["event_id"]) not in work.ids()
        rejected = {r.key for r in dlq.records if r.headers.get("calmq-error-code")}
        assert not rejected & {str(b["job_id"]) for b in (*before, *after)}
    finally:
        work.close()
