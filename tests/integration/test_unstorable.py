"""Text PostgreSQL refuses, in what a step produces, ends that job with a clear failure on
the session stack's worker: a NUL in an uploaded invoice text and in a model's output fail
their jobs as ``input`` / ``unstorable_output`` after one attempt (one model call at most),
while jobs beside them complete (issue 27: one such outcome wedged a group commit)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest

from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

TERMINAL = ("completed", "dead_letter", "cancelled")
BOUNDARY = "unstorableboundary"


@pytest.fixture(scope="module")
def api(stack: StackState) -> Api:
    return Api(stack.env["CALMQ_API_URL"],
               create_tenant(stack.env["CALMQ_DATABASE_URL"], f"nul-{uuid.uuid4().hex[:8]}"))


def _upload(api: Api, workflow: str, name: str, content_type: str, data: bytes) -> str:
    body = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"workflow\"\r\n\r\n"
            f"{workflow}\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"{name}\"\r\nContent-Type: {content_type}\r\n\r\n").encode()
    body += data + f"\r\n--{BOUNDARY}--\r\n".encode()
    status, _h, answer = api.call(
        "POST", "/v1/jobs", raw=body,
        headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert status == 202, answer
    return str(answer["job_id"])


def _finished(api: Api, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = wait_for(lambda: (j := api.job(job_id))["status"] in TERMINAL and j,
                                   timeout=90, what=f"job {job_id} to end")
    return job


def _attempts(stack: StackState, job_id: str) -> list[tuple[str, int, int]]:
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        return [(str(r[0]), int(r[1]), int(r[2])) for r in conn.execute(
            "SELECT step, attempt, model_calls FROM job_attempts WHERE job_id = %s"
            " ORDER BY started_at", (job_id,))]


def _assert_unstorable(job: dict[str, Any]) -> None:
    assert job["status"] == "dead_letter", job
    assert job["error"]["code"] == "unstorable_output"
    assert job["error"]["class"] == "input"
    assert "NUL" in job["error"]["message"]
    assert "\x00" not in json.dumps(job, ensure_ascii=False)


def test_nul_in_an_uploaded_invoice_text_fails_its_job_and_not_its_neighbours(
    stack: StackState, api: Api
) -> None:
    """An invoice text file with a NUL byte ends dead_letter/unstorable_output after its
    first step's one attempt, with no model call; jobs submitted with it complete."""
    bad = _upload(api, "invoice", "invoice.txt", "text/plain",
                  b"Vendor: ACME Tools\x00GmbH\nInvoice: INV-1\nTotal: EUR 12.50\n")
    others = [api.submit({"text": f"neighbour {i}", "mode": "success"}) for i in range(8)]
    job = _finished(api, bad)
    _assert_unstorable(job)
    assert _attempts(stack, bad) == [("extract_text", 1, 0)]
    assert [_finished(api, o)["status"] for o in others] == ["completed"] * 8


def test_nul_in_model_output_fails_its_job_after_one_paid_call(
    stack: StackState, api: Api
) -> None:
    """A model answer holding a NUL (the fake echoes the uploaded text's words; low
    confidence puts the output in the review_requested event) ends the job as
    unstorable_output after exactly one model call; jobs submitted with it complete."""
    payload = json.dumps({"text": "before\u0000after and more words", "mode": "low_confidence"})
    bad = _upload(api, "summarize", "input.json", "application/json", payload.encode())
    others = [api.submit({"text": f"neighbour {i}", "mode": "success"}) for i in range(8)]
    job = _finished(api, bad)
    _assert_unstorable(job)
    assert _attempts(stack, bad) == [("summarize", 1, 1)]
    assert [_finished(api, o)["status"] for o in others] == ["completed"] * 8
