"""The walking skeleton end to end: HTTP -> PostgreSQL -> relay -> Kafka -> worker -> result."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from calmq.codec import make_codec
from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant, lifecycle
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def api(stack: StackState) -> Api:
    key = create_tenant(stack.env["CALMQ_DATABASE_URL"], f"e2e-{uuid.uuid4().hex[:8]}")
    return Api(stack.env["CALMQ_API_URL"], key)


def _terminal(api: Api, job_id: str) -> dict:
    return wait_for(
        lambda: (j := api.job(job_id))["status"] in ("completed", "dead_letter", "cancelled") and j,
        timeout=60,
        what=f"job {job_id} to finish",
    )


def test_submitted_job_completes_with_artifact_through_kafka(api: Api, stack: StackState) -> None:
    """A summarize job submitted over HTTP ends completed, with its artifact, via real topics."""
    job_id = api.submit(
        {"text": "Kafka and PostgreSQL carry this job end to end.", "mode": "success"},
        metadata={"order_id": "A-1017"},
    )
    job = _terminal(api, job_id)
    assert job["status"] == "completed"
    assert job["attempt"] == 1
    assert lifecycle(job["events"]) == ["queued", "running", "completed"]
    artifact = job["artifact"]
    assert artifact["content_type"] == "application/json"
    assert len(artifact["sha256"]) == 64
    with open(artifact["uri"].removeprefix("file://"), encoding="utf-8") as fh:
        assert '"summary"' in fh.read()

    # The result event is on calmq.results in Avro, keyed by the job id.
    codec = make_codec(stack.env["CALMQ_SCHEMA_REGISTRY_URL"])
    consumer = Consumer(
        {
            "bootstrap.servers": stack.env["CALMQ_KAFKA_BOOTSTRAP"],
            "group.id": f"test-{uuid.uuid4()}",
            "auto.offset.reset": "earliest",
        }
    )
    try:
        meta = consumer.list_topics("calmq.results", timeout=10)
        consumer.assign(
            [TopicPartition("calmq.results", p, 0) for p in meta.topics["calmq.results"].partitions]
        )
        found: dict = {}

        def result_seen() -> bool:
            for msg in consumer.consume(100, timeout=0.2):
                if msg.error() is None and msg.key() == job_id.encode():
                    found["headers"] = dict(msg.headers() or [])
                    found["event"] = codec.decode(msg.value())
            return bool(found)

        wait_for(result_seen, timeout=30, what="the result event on calmq.results")
    finally:
        consumer.close()
    event_type, event = found["event"]
    assert event_type == "job.result"
    assert event["status"] == "completed"
    # What a consumer correlates and accounts with: the submit's metadata, the workflow's
    # version, and the usage the API reports for the job (all attempts).
    assert json.loads(event["metadata"]) == {"order_id": "A-1017"}
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        [(version,)] = conn.execute("SELECT workflow_version FROM jobs WHERE id = %s",
                                    (job_id,)).fetchall()
    assert event["workflow_version"] == version
    usage = event["usage"]
    assert usage["input_tokens"] == job["usage"]["input_tokens"] > 0
    assert usage["output_tokens"] == job["usage"]["output_tokens"] > 0
    assert usage["cost_usd"] == pytest.approx(job["usage"]["cost_usd"])
    assert usage["lane"] == "online"
    assert found["headers"]["eventType"] == b"job.result"
    assert uuid.UUID(found["headers"]["id"].decode()) == uuid.UUID(str(event["event_id"]))


def test_malformed_output_dead_letters_as_verifier(api: Api) -> None:
    """A model answer that is not the schema dead-letters at once: class verifier, 1 attempt."""
    job = _terminal(api, api.submit({"text": "please be malformed", "mode": "malformed"}))
    assert job["status"] == "dead_letter"
    assert job["attempt"] == 1
    assert job["error"]["class"] == "verifier"
    assert job["error"]["code"] == "malformed_output"
    assert lifecycle(job["events"]) == ["queued", "running", "dead_lettered"]


def test_status_shape_is_stable_while_queued(api: Api) -> None:
    """GET /v1/jobs/{id} has every field of the contract from the first moment.

    Fields beyond the contract (usage: tokens and cost) may be added; none may go missing.
    """
    job = api.job(api.submit({"text": "shape", "mode": "success"}))
    assert {
        "job_id",
        "workflow",
        "status",
        "attempt",
        "step",
        "artifact",
        "error",
        "created_at",
        "updated_at",
        "events",
    } <= set(job)
    assert set(job["events"][0]) == {"type", "at", "attempt", "detail"}


def test_same_idempotency_key_same_body_answers_same_job(api: Api, stack: StackState) -> None:
    """The same Idempotency-Key with the same body answers the same job, and one row exists."""
    key = f"idem-{uuid.uuid4()}"
    body = {"workflow": "summarize", "input": {"text": "once only"}}
    first = api.call("POST", "/v1/jobs", body, headers={"Idempotency-Key": key})
    second = api.call("POST", "/v1/jobs", body, headers={"Idempotency-Key": key})
    assert first[0] == second[0] == 202
    assert first[2]["job_id"] == second[2]["job_id"]
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        rows = conn.execute(
            "SELECT count(*) FROM jobs j JOIN idempotency_keys k ON k.job_id = j.id "
            "WHERE k.key = %s",
            (key,),
        ).fetchone()
    assert rows == (1,)


def test_same_idempotency_key_different_body_is_409(api: Api) -> None:
    """Reusing an Idempotency-Key with another body answers 409 problem+json."""
    key = f"idem-{uuid.uuid4()}"
    ok = api.call(
        "POST",
        "/v1/jobs",
        {"workflow": "summarize", "input": {"text": "a"}},
        headers={"Idempotency-Key": key},
    )
    clash = api.call(
        "POST",
        "/v1/jobs",
        {"workflow": "summarize", "input": {"text": "b"}},
        headers={"Idempotency-Key": key},
    )
    assert ok[0] == 202
    assert clash[0] == 409
    assert clash[1]["Content-Type"].startswith("application/problem+json")
    assert clash[2]["code"] == "idempotency_key_reused"


def test_other_tenant_gets_404(api: Api, stack: StackState) -> None:
    """A second tenant asking for the first tenant's job gets 404, not 403."""
    job_id = api.submit({"text": "mine"})
    other = Api(
        api.base_url, create_tenant(stack.env["CALMQ_DATABASE_URL"], f"o-{uuid.uuid4().hex[:8]}")
    )
    status, headers, body = other.call("GET", f"/v1/jobs/{job_id}")
    assert status == 404
    assert headers["Content-Type"].startswith("application/problem+json")
    assert body["code"] == "not_found"
