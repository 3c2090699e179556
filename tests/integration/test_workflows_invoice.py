"""Multi-step workflows on the real stack: the invoice across two pools, a worker killed
with -9 between extract_fields and the ledger posting, and embed_document in batches."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from calmq.tooling.devstack import StackState
from tests.support.pdf import tiny_pdf
from tests.support.waiting import wait_for
from tests.support.workflow_env import WorkflowEnv
from tests.support.workflows import LEDGER_POOL

pytestmark = pytest.mark.integration

INVOICE = "Vendor: ACME Tools GmbH\nInvoice: INV-2041\nDate: 2026-11-02\nTotal: EUR 1,240.50\n"
FIELDS = {"vendor": "ACME Tools GmbH", "invoice_number": "INV-2041", "total": 1240.5,
          "currency": "EUR"}


def _explain(job: dict[str, Any]) -> object:
    return job["error"], [(e["type"], e["detail"]) for e in job["events"]]


@pytest.fixture(scope="module")
def wf(stack: StackState) -> Iterator[WorkflowEnv]:
    env = WorkflowEnv(stack)
    try:
        yield env
    finally:
        env.close()


def test_invoice_runs_each_step_once_on_its_pool_and_posts_once(wf: WorkflowEnv) -> None:
    """The invoice moves extract_text -> extract_fields -> post_ledger, the ledger step on
    its own pool's worker, with one attempt and one model call, and one ledger posting."""
    job_id = wf.submit("invoice_t", {"text": INVOICE})
    job = wf.wait_status(job_id, "completed", "dead_letter")
    assert job["status"] == "completed", _explain(job)
    assert wf.attempts(job_id) == {"extract_text": 1, "extract_fields": 1, "post_ledger": 1}
    assert wf.provider_calls(job_id) == 1
    postings = wf.ledger.for_job(job_id)
    assert len(postings) == 1
    assert postings[0]["fields"] == FIELDS
    workers = {r["step"]: r["worker"] for r in wf.sql(
        "SELECT step, worker FROM job_attempts WHERE job_id = %s", job_id)}
    assert workers["post_ledger"] != workers["extract_fields"]  # routed to the ledger pool
    moves = [e["detail"] for e in job["events"] if e["type"] == "step_completed"]
    assert [(m["step"], m["next_step"], m["pool"]) for m in moves] == [
        ("extract_text", "extract_fields", "wft"), ("extract_fields", "post_ledger", LEDGER_POOL)]
    status, _h, artifact = wf.api.call("GET", f"/v1/jobs/{job_id}/artifact")
    assert status == 200
    assert artifact["fields"] == FIELDS
    assert artifact["posting"]["posting_id"] == postings[0]["posting_id"]


@pytest.mark.parametrize("book_first", [True, False], ids=["after-call", "before-call-landed"])
def test_kill_9_before_the_ledger_answered_resumes_at_the_ledger_step(
    wf: WorkflowEnv, book_first: bool
) -> None:
    """Killed with -9 while posting to the ledger (extract_fields done): after the restart
    neither the text nor the fields are extracted again, the model is not called again, and
    the ledger holds exactly one posting for the invoice."""
    wf.ledger.hold(book_first=book_first)
    job_id = wf.submit("invoice_t", {"text": INVOICE})
    wait_for(wf.ledger.held.is_set, timeout=60, what="the ledger post to arrive")
    os.kill(wf.ledger_worker.pid, signal.SIGKILL)
    wf.ledger_worker.wait(timeout=10)
    wf.ledger.release()
    recorded = wf.sql("SELECT step, state FROM step_outputs WHERE job_id = %s ORDER BY step",
                      job_id)
    assert {r["step"]: r["state"] for r in recorded} == {"extract_fields": "done",
                                                         "extract_text": "done"}
    wf.ledger_worker, wf.ledger_worker_port = wf.start_worker(LEDGER_POOL)
    job = wf.wait_status(job_id, "completed", "dead_letter", timeout=90)
    assert job["status"] == "completed", _explain(job)
    attempts = wf.attempts(job_id)
    assert attempts["extract_text"] == 1
    assert attempts["extract_fields"] == 1
    assert attempts["post_ledger"] == 2
    assert wf.provider_calls(job_id) == 1
    assert len(wf.ledger.for_job(job_id)) == 1
    keys = wf.ledger.requests_for(job_id)
    assert len(keys) == 2
    assert len(set(keys)) == 1
    assert "requeued_after_restart" in [e["type"] for e in job["events"]]


def test_an_uploaded_pdf_invoice_is_read_and_posted(wf: WorkflowEnv) -> None:
    """A PDF uploaded as multipart goes through the same steps: its text layer is
    extracted, the fields are read from it and posted to the ledger."""
    boundary = "calmqtestboundary"
    pdf = tiny_pdf(INVOICE.strip().split("\n"))
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"workflow\"\r\n\r\n"
            f"invoice_t\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"inv.pdf\"\r\nContent-Type: application/pdf\r\n\r\n").encode()
    body += pdf + f"\r\n--{boundary}--\r\n".encode()
    status, _h, answer = wf.api.call(
        "POST", "/v1/jobs", raw=body,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 202, answer
    job_id = answer["job_id"]
    job = wf.wait_status(job_id, "completed", "dead_letter")
    assert job["status"] == "completed", _explain(job)
    [posting] = wf.ledger.for_job(job_id)
    assert posting["fields"] == FIELDS


def test_embed_document_embeds_chunks_in_batches(wf: WorkflowEnv) -> None:
    """embed_document chunks the text, embeds the chunks in batches, and its artifact
    references the vectors in the object store."""
    text = "\n\n".join(f"Paragraph {i}: " + "word " * 30 for i in range(7))
    job_id = wf.submit("embed_t", {"text": text, "chunk_chars": 200, "batch_size": 3})
    job = wf.wait_status(job_id, "completed", "dead_letter")
    assert job["status"] == "completed", _explain(job)
    status, _h, artifact = wf.api.call("GET", f"/v1/jobs/{job_id}/artifact")
    assert status == 200
    assert artifact["chunks"] == 7
    assert artifact["batches"] == 3
    assert artifact["dimensions"] == 8
    vectors = json.loads(Path(urlparse(artifact["vectors"]["uri"]).path).read_bytes())
    assert [v["index"] for v in vectors] == list(range(7))
    # Each batch is an embed_batch child job of its own (embed_document v2): the calls are
    # the children's, one each, and the parent itself calls nothing.
    status, _h, page = wf.api.call("GET", f"/v1/jobs/{job_id}/children")
    assert status == 200
    children = [c["job_id"] for c in page["children"]]
    assert len(children) == 3
    assert [wf.provider_calls(c) for c in children] == [1, 1, 1]
    assert wf.provider_calls(job_id) == 0
