"""Input by reference obeys the workflow's rules (issue 15).

A workflow declares what it accepts by reference (a multipart ``file`` or ``input_ref``):
media types and a maximum size. The API refuses anything else with a stable code and keeps
nothing; the worker reads a referenced input bounded by that maximum (an object grown after
the check is refused, not read whole) and holds its text to the workflow's input model, and
``embed_document`` reads a large document in chunks.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import psycopg
import pytest

from calmq.producers.client import enqueue
from calmq.tooling.devstack import StackState
from calmq.workflows.embed_document import chunk_text
from calmq.workflows.summarize import SUMMARIZE
from tests.support.api import Api
from tests.support.waiting import wait_for
from tests.support.workers import TERMINAL, create_tenant_id

pytestmark = pytest.mark.integration

BOUNDARY = "calmqrefboundary"
HEADERS = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
SUMMARIZE_MAX = SUMMARIZE.by_reference.max_bytes if SUMMARIZE.by_reference else 0


def _multipart(workflow: str, data: bytes, content_type: str, *, first: bool = True) -> bytes:
    field = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"workflow\"\r\n\r\n"
             f"{workflow}\r\n").encode()
    file = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"doc\"\r\nContent-Type: {content_type}\r\n\r\n").encode() + data + b"\r\n"
    body = field + file if first else file + field
    return body + f"--{BOUNDARY}--\r\n".encode()


def _tenant(stack: StackState) -> tuple[Api, uuid.UUID]:
    tenant, key = create_tenant_id(stack.env["CALMQ_DATABASE_URL"],
                                   f"byref-{uuid.uuid4().hex[:8]}")
    return Api(stack.env["CALMQ_API_URL"], key), tenant


def _store_root(stack: StackState) -> Path:
    return Path(unquote(urlparse(stack.env["CALMQ_OBJECT_STORE_URL"]).path))


def _objects(stack: StackState, tenant: uuid.UUID) -> list[Path]:
    root = _store_root(stack) / str(tenant)
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _place(stack: StackState, tenant: uuid.UUID, name: str, data: bytes) -> str:
    """An object the tenant uploaded to its own prefix by other means; its URI."""
    path = _store_root(stack) / str(tenant) / "inputs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path.as_uri()


def _jobs(stack: StackState, tenant: uuid.UUID) -> int:
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        row = conn.execute("SELECT count(*) FROM jobs WHERE tenant_id = %s",
                           (tenant,)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(("data", "content_type", "first", "status", "code"), [
    pytest.param(b"word " * (SUMMARIZE_MAX // 5 + 1), "text/plain", True, 413,
                 "input_too_large", id="over-the-max-workflow-first"),
    pytest.param(b"word " * (SUMMARIZE_MAX // 5 + 1), "text/plain", False, 413,
                 "input_too_large", id="over-the-max-file-first"),
    pytest.param(b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "image/png", True, 415,
                 "unsupported_input_type", id="undeclared-type"),
])
def test_a_file_the_workflow_does_not_accept_is_refused_and_nothing_is_stored(
        stack: StackState, data: bytes, content_type: str, first: bool, status: int,
        code: str) -> None:
    """A multipart file over summarize's maximum, or of a type it does not declare, is a
    problem with a stable code; no object and no job remain (the default upload limit,
    100 MB, would have taken it)."""
    api, tenant = _tenant(stack)
    got, headers, body = api.call("POST", "/v1/jobs",
                                  raw=_multipart("summarize", data, content_type, first=first),
                                  headers=HEADERS)
    assert got == status, body
    assert headers["Content-Type"].startswith("application/problem+json")
    assert body["code"] == code
    assert _objects(stack, tenant) == []
    assert not list((_store_root(stack) / str(tenant)).rglob("*.up"))
    assert _jobs(stack, tenant) == 0


def test_an_input_ref_the_workflow_does_not_accept_is_refused(stack: StackState) -> None:
    """input_ref to an object over the maximum, of an undeclared type, or to nothing at all
    answers 413 / 415 / 422 with its code; no job is written."""
    api, tenant = _tenant(stack)
    big = _place(stack, tenant, "big.txt", b"word " * (SUMMARIZE_MAX // 5 + 1))
    pdf = _place(stack, tenant, "scan.pdf", b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    missing = big.replace("big.txt", "nothing-here.txt")
    for ref, status, code in ((big, 413, "input_too_large"),
                              (pdf, 415, "unsupported_input_type"),
                              (missing, 422, "input_ref_not_found")):
        got, headers, body = api.call("POST", "/v1/jobs",
                                      {"workflow": "summarize", "input_ref": ref})
        assert got == status, (ref, body)
        assert headers["Content-Type"].startswith("application/problem+json")
        assert body["code"] == code
    assert _jobs(stack, tenant) == 0


def _finished(api: Api, job_id: str, timeout: float = 90) -> dict[str, Any]:
    return wait_for(lambda: (j := api.job(job_id))["status"] in TERMINAL and j,
                    timeout=timeout, what=f"job {job_id} to finish")


def test_the_worker_reads_a_referenced_input_bounded_by_the_workflow(
        stack: StackState) -> None:
    """A referenced text that grew past summarize's maximum after the API checked it (here:
    written through the embedded client, which does not read the store) is refused by the
    worker as ``input_too_large`` (class input, no model call), not read whole and sent to
    the model; one that fits completes like an inline input."""
    api, tenant = _tenant(stack)
    grown = _place(stack, tenant, "grown.txt", b"word " * (SUMMARIZE_MAX // 5 * 6))
    fits = _place(stack, tenant, "fits.txt", b"a short document about quotas")
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn, conn.transaction():
        too_big = enqueue(conn, tenant_id=tenant, workflow="summarize", input_ref=grown)
        fine = enqueue(conn, tenant_id=tenant, workflow="summarize", input_ref=fits)
    refused = _finished(api, str(too_big))
    assert refused["status"] == "dead_letter", refused
    assert refused["error"]["code"] == "input_too_large"
    assert refused["error"]["class"] == "input"
    assert refused["usage"]["input_tokens"] == 0  # the model was never called
    assert _finished(api, str(fine))["status"] == "completed"


def test_a_large_referenced_document_is_chunked_as_a_stream(stack: StackState) -> None:
    """A 1 MB text (over summarize's maximum, under embed_document's) uploaded as a file is
    accepted for embed_document and chunked exactly as the same text inline would be."""
    api, _tenant_id = _tenant(stack)
    paragraph = "Quotas keep one tenant from starving the others. " * 20
    text = "\n\n".join(f"{i}: {paragraph}" for i in range(1000))
    data = text.encode()
    assert SUMMARIZE_MAX < len(data) < 20 * 1024 * 1024
    got, _h, body = api.call("POST", "/v1/jobs",
                             raw=_multipart("embed_document", data, "text/plain"),
                             headers=HEADERS)
    assert got == 202, body
    done = _finished(api, body["job_id"], timeout=180)
    assert done["status"] == "completed", done
    assert done["artifact"] is not None
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        row = conn.execute("SELECT output FROM step_outputs WHERE job_id = %s AND step = 'chunk'",
                           (body["job_id"],)).fetchone()
    assert row is not None
    assert row[0]["count"] == len(chunk_text(text, 1000))
