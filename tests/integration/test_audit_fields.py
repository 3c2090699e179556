"""Audit fields come from the key that made the call: the ``by`` of a redrive and the
``reviewer`` of a review over the API are ``tenant <name> key <prefix>``, whatever the body
claims; the body's free text is kept beside them as a note (issue 15)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from calmq.tooling.devstack import StackState
from tests.support.workflow_env import WorkflowEnv

pytestmark = pytest.mark.integration

INVOICE = "Vendor: Blurry Scan Ltd\nInvoice: 7?1\nTotal: EUR 88.00\n"


@pytest.fixture(scope="module")
def wf(stack: StackState) -> Iterator[WorkflowEnv]:
    env = WorkflowEnv(stack)
    try:
        yield env
    finally:
        env.close()


def test_a_review_records_the_calling_key_not_the_body(wf: WorkflowEnv) -> None:
    job_id = wf.submit("invoice_t", {"text": INVOICE, "mode": "low_confidence"})
    assert wf.wait_status(job_id, "awaiting_review", "completed", "dead_letter")["status"] \
        == "awaiting_review"
    status, _h, job = wf.api.call("POST", f"/v1/jobs/{job_id}/review",
                                  {"decision": "reject", "reviewer": "someone else"})
    assert status == 200, job
    [reviewed] = [e["detail"] for e in job["events"] if e["type"] == "reviewed"]
    assert reviewed["reviewer"] == wf.identity
    assert reviewed["reviewer_note"] == "someone else"
    [row] = wf.sql("SELECT reviewer FROM step_outputs WHERE job_id = %s AND state = 'rejected'",
                   job_id)
    assert row["reviewer"] == wf.identity
    # Without a reviewer in the body the call is just as well attributed.
    other = wf.submit("invoice_t", {"text": INVOICE, "mode": "low_confidence"})
    wf.wait_status(other, "awaiting_review")
    status, _h, job = wf.api.call("POST", f"/v1/jobs/{other}/review", {"decision": "reject"})
    assert status == 200, job
    [reviewed] = [e["detail"] for e in job["events"] if e["type"] == "reviewed"]
    assert reviewed["reviewer"] == wf.identity
    assert "reviewer_note" not in reviewed


def test_a_redrive_records_the_calling_key_not_the_body(wf: WorkflowEnv) -> None:
    job_id = wf.submit("summarize_t", {"text": "audit me", "mode": "malformed"})
    assert wf.wait_status(job_id, "completed", "dead_letter")["status"] == "dead_letter"
    status, _h, body = wf.api.call("POST", f"/v1/dead-letters/{job_id}/redrive",
                                   {"reason": "try again", "by": "someone else"})
    assert status == 200, body
    [redriven] = [e["detail"] for e in body["events"] if e["type"] == "redriven"]
    assert redriven["by"] == wf.identity
    assert redriven["by_note"] == "someone else"
    assert redriven["reason"] == "try again"
