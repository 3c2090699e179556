"""embed_document on child jobs (issue 43), on the stack's own API, worker and fake provider:
each batch of chunks is an ``embed_batch`` child with its own retries, so a batch that fails
transiently is called again alone, and no batch already answered is paid for twice."""

from __future__ import annotations

import json
import math
import urllib.request
import uuid

import psycopg
import pytest

from calmq.tooling.devstack import StackState
from calmq.workflows.embed_document import chunk_text
from tests.support.api import Api
from tests.support.waiting import wait_for
from tests.support.workers import create_tenant_id, fake_stats

pytestmark = pytest.mark.integration

PAGES = 300
CHUNK_CHARS = 1000
BATCH = 16


def _page(n: int) -> str:
    """About 1,800 characters of a page: a paragraph a page, each word-separated marker
    (MARK150X) found in exactly one chunk."""
    return (f"Page {n} MARK{n:03d}X of the quarterly report. " + "The figures of the quarter "
            "are in line with the plan and the team expects the same next quarter. " * 20)


def test_a_batch_failing_twice_is_retried_alone(stack: StackState) -> None:
    """A 300-page document with one batch failing transiently twice pays each batch once."""
    db = stack.env["CALMQ_DATABASE_URL"]
    provider = stack.env["CALMQ_FAKE_PROVIDER_URL"]
    _tenant, key = create_tenant_id(db, f"embed-{uuid.uuid4().hex[:8]}")
    api = Api(stack.env["CALMQ_API_URL"], key)
    text = "\n\n".join(_page(n) for n in range(PAGES))
    marker = f"MARK150X-{uuid.uuid4().hex[:6]}"
    text = text.replace("MARK150X", marker)
    flaky = urllib.request.Request(provider + "/admin/flaky", method="POST",
                                   data=json.dumps({"contains": marker, "times": 2}).encode(),
                                   headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(flaky, timeout=10) as resp:
        assert resp.status == 200
    status, _h, body = api.call("POST", "/v1/jobs", {
        "workflow": "embed_document",
        "input": {"text": text, "chunk_chars": CHUNK_CHARS, "batch_size": BATCH}})
    assert status == 202, body
    parent = str(body["job_id"])
    job = wait_for(lambda: (j := api.job(parent))["status"] in (
        "completed", "dead_letter", "cancelled") and j, timeout=300,
        what="the document to be embedded")
    assert job["status"] == "completed", job
    chunks = len(chunk_text(text, CHUNK_CHARS))
    batches = math.ceil(chunks / BATCH)
    status, _h, artifact = api.call("GET", f"/v1/jobs/{parent}/artifact")
    assert status == 200, artifact
    assert (artifact["chunks"], artifact["batches"]) == (chunks, batches)
    with psycopg.connect(db) as conn:
        kids = [str(r[0]) for r in conn.execute(
            "SELECT id FROM jobs WHERE parent_id = %s ORDER BY child_index", (parent,))]
    assert len(kids) == batches
    by_job = fake_stats(provider)["by_job"]
    calls = [by_job[k]["calls"] for k in kids]
    # The failing batch: its two 503s, then its answer; every other batch: one call.
    failing = next(i for i, c in enumerate(calls) if c != 1)
    assert calls == [1] * failing + [3] + [1] * (batches - failing - 1)
    # Answered (paid) once each: none paid again for another batch's failure.
    assert [by_job[k]["completed"] for k in kids] == [1] * batches
