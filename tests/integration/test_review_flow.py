"""Human review on the real stack: approve with corrected fields, reject, the review timer,
the API's errors, and 1,000 waiting jobs that hold no worker slot, pause or transaction."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from confluent_kafka import Consumer, TopicPartition

from calmq import topics
from calmq.tooling.devstack import StackState
from tests.support.api import Api
from tests.support.waiting import wait_for
from tests.support.workers import create_tenant_id, metric
from tests.support.workflow_env import WorkflowEnv
from tests.support.workflows import POOL

pytestmark = pytest.mark.integration

INVOICE = "Vendor: Blurry Scan Ltd\nInvoice: 7?1\nTotal: EUR 88.00\n"


@pytest.fixture(scope="module")
def wf(stack: StackState) -> Iterator[WorkflowEnv]:
    env = WorkflowEnv(stack)
    try:
        yield env
    finally:
        env.close()


def _waiting(wf: WorkflowEnv, workflow: str) -> str:
    job_id = wf.submit(workflow, {"text": INVOICE, "mode": "low_confidence"})
    job = wf.wait_status(job_id, "awaiting_review", "completed", "dead_letter")
    assert job["status"] == "awaiting_review", job
    return job_id


def _review(wf: WorkflowEnv, job_id: str, body: dict[str, object]) -> tuple[int, dict]:  # type: ignore[type-arg]
    status, _h, answer = wf.api.call("POST", f"/v1/jobs/{job_id}/review", body)
    return status, answer


def test_approved_corrections_flow_into_the_ledger(wf: WorkflowEnv) -> None:
    """Low confidence -> awaiting_review, listed with the model's output; approving with
    corrected fields resumes the job and the ledger receives the corrected fields."""
    job_id = _waiting(wf, "invoice_t")
    status, _h, listed = wf.api.call("GET", "/v1/reviews")
    assert status == 200
    review = next(r for r in listed["reviews"] if r["job_id"] == job_id)
    assert review["step"] == "extract_fields"
    assert review["confidence"] < 0.9
    assert review["output"]["vendor"] == "Blurry Scan Ltd"
    assert review["deadline_at"]
    assert wf.ledger.for_job(job_id) == []
    status, job = _review(wf, job_id, {"decision": "approve", "reviewer": "alice@example.com",
                                       "fields": {"invoice_number": "791", "total": 88.5}})
    assert status == 200, job
    job = wf.wait_status(job_id, "completed", "dead_letter")
    assert job["status"] == "completed", job
    posting = wf.ledger.for_job(job_id)
    assert len(posting) == 1
    assert posting[0]["fields"] == {"vendor": "Blurry Scan Ltd", "invoice_number": "791",
                                    "total": 88.5, "currency": "EUR"}
    reviewed = [e["detail"] for e in job["events"] if e["type"] == "reviewed"]
    assert reviewed == [{"decision": "approve", "reviewer": wf.identity,
                         "reviewer_note": "alice@example.com", "step": "extract_fields",
                         "fields": {"invoice_number": "791", "total": 88.5}}]
    assert wf.provider_calls(job_id) == 1  # the approval did not ask the model again
    _status, _h, listed = wf.api.call("GET", "/v1/reviews")
    assert job_id not in [r["job_id"] for r in listed["reviews"]]


def test_reject_dead_letters_with_review_rejected(wf: WorkflowEnv) -> None:
    """Rejecting a review dead-letters the job (class verifier, code review_rejected) with
    the reviewer in its history, and nothing is posted."""
    job_id = _waiting(wf, "invoice_t")
    status, job = _review(wf, job_id, {"decision": "reject", "reviewer": "bob",
                                       "reason": "not our invoice"})
    assert status == 200, job
    assert job["status"] == "dead_letter", job
    assert job["error"] == {"code": "review_rejected", "class": "verifier",
                            "message": "not our invoice"}
    assert ("reviewed", wf.identity, "bob") in [
        (e["type"], e["detail"].get("reviewer"), e["detail"].get("reviewer_note"))
        for e in job["events"]]
    assert wf.ledger.for_job(job_id) == []


def test_review_errors_have_stable_codes(wf: WorkflowEnv) -> None:
    """Another tenant's job answers 404, a job not awaiting review 409, a bad decision 422,
    and a correction that does not fit the output model 422 -- each changing nothing."""
    job_id = _waiting(wf, "invoice_t")
    _tenant, other_key = create_tenant_id(wf.db, f"wf-other-{uuid.uuid4().hex[:6]}")
    other = Api(wf.api_url, other_key)
    status, _h, body = other.call("POST", f"/v1/jobs/{job_id}/review",
                                  {"decision": "approve", "reviewer": "mallory"})
    assert (status, body["code"]) == (404, "not_found")
    _s, _h, listed = other.call("GET", "/v1/reviews")
    assert job_id not in [r["job_id"] for r in listed["reviews"]]
    status, body = _review(wf, job_id, {"decision": "maybe", "reviewer": "alice"})
    assert (status, body["code"]) == (422, "invalid_body")
    status, body = _review(wf, job_id, {"decision": "approve", "reviewer": "alice",
                                        "fields": {"total": "lots"}})
    assert (status, body["code"]) == (422, "invalid_fields")
    assert wf.job(job_id)["status"] == "awaiting_review"
    status, _job = _review(wf, job_id, {"decision": "reject", "reviewer": "alice"})
    assert status == 200
    status, body = _review(wf, job_id, {"decision": "approve", "reviewer": "alice"})
    assert (status, body["code"]) == (409, "not_awaiting_review")


@pytest.mark.parametrize(("workflow", "outcome"), [
    ("invoice_t_expires", "dead_letter"), ("invoice_t_expires_approved", "completed")])
def test_review_deadline_applies_the_configured_outcome(
    wf: WorkflowEnv, workflow: str, outcome: str
) -> None:
    """A review nobody decides before its deadline (1 s here) gets its workflow's outcome:
    dead_letter (review_expired) or approval of the model's output; the timer is the
    reviewer in the history."""
    job_id = _waiting(wf, workflow)
    job = wf.wait_status(job_id, "completed", "dead_letter", timeout=60)
    assert job["status"] == outcome, job
    reviewed = [e["detail"] for e in job["events"] if e["type"] == "reviewed"]
    assert len(reviewed) == 1
    assert reviewed[0]["reviewer"] == "calmq:review-timer"
    assert reviewed[0]["expired"] is True
    if outcome == "dead_letter":
        assert job["error"]["code"] == "review_expired"
        assert wf.ledger.for_job(job_id) == []
    else:
        assert wf.ledger.for_job(job_id)[0]["fields"]["vendor"] == "Blurry Scan Ltd"


def _committed_everything(bootstrap: str, pool: str) -> bool:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"calmq.{pool}",
                         "enable.auto.commit": False})
    try:
        names = [topics.topic_for_route(topics.work_route(pool, p))
                 for p in ("interactive", "bulk")]
        meta = consumer.list_topics(timeout=10)
        parts = [TopicPartition(t, p) for t in names for p in meta.topics[t].partitions]
        committed = consumer.committed(parts, timeout=10)
        for tp in committed:
            _low, high = consumer.get_watermark_offsets(tp, timeout=10)
            if high > 0 and tp.offset < high:
                return False
        return True
    finally:
        consumer.close()


def test_a_thousand_waiting_reviews_hold_nothing(wf: WorkflowEnv) -> None:
    """1,000 jobs in awaiting_review hold no lease, no worker slot (in-flight 0, and a new
    job still runs on the pool's one worker, whose concurrency of 256 is below 1,000), no
    consumer pause (every offset committed, the new job is consumed) and no open
    transaction."""
    body = {"workflow": "summarize_t", "input": {"text": "a blurry fax", "mode": "low_confidence"}}

    def submit(_i: int) -> str:
        status, _h, answer = wf.api.call("POST", "/v1/jobs", body)
        assert status == 202, answer
        return str(answer["job_id"])

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(submit, range(1000)))
    wait_for(lambda: wf.sql("SELECT count(*)::int AS n FROM jobs WHERE id = ANY(%s::uuid[]) "
                            "AND status = 'awaiting_review'", ids)[0]["n"] == 1000,
             timeout=240, what="1,000 jobs to wait for review")
    leased = wf.sql("SELECT count(*)::int AS n FROM jobs WHERE id = ANY(%s::uuid[]) "
                    "AND lease_owner IS NOT NULL", ids)[0]["n"]
    assert leased == 0
    assert wait_for(lambda: metric(wf.worker_port, "calmq_worker_in_flight") == 0,
                    timeout=10, what="no job in flight on the worker")
    bootstrap = wf.stack.env["CALMQ_KAFKA_BOOTSTRAP"]
    wait_for(lambda: _committed_everything(bootstrap, POOL), timeout=30,
             what="every offset of the pool committed")
    open_tx = wf.sql("SELECT count(*)::int AS n FROM pg_stat_activity WHERE xact_start IS "
                     "NOT NULL AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
                     "AND xact_start < now() - interval '2 seconds'")[0]["n"]
    assert open_tx == 0
    fresh = wf.submit("summarize_t", {"text": "a clear invoice text"})
    job = wf.wait_status(fresh, "completed", "dead_letter", timeout=60)
    assert job["status"] == "completed"
