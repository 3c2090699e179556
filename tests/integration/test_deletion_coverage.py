"""Deletion removes everything of a job (issue 15).

The catalog test reads every table with a ``job_id`` or ``tenant_id`` column (and ``jobs``)
from the real database and fails when one is missing from calmq.data.retention.COVERAGE,
the map of how a purge handles each table: a new table must be given a line there.

The end-to-end test runs jobs that write every kind of data a job can leave -- a multipart
summarize with a webhook, metadata and an idempotency key; an embed_document with chunk and
vector objects; a reviewed invoice whose corrections and ledger side effect are recorded; a
dead letter redriven into a second round of attempts -- each carrying unique marker strings,
DELETEs them, and then finds none of their input, output or error text in any column of any
row of any table, and no object of theirs in the store; the accounting stays.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import psycopg
import pytest

from calmq.data.retention import COVERAGE
from calmq.tooling.devstack import StackState, processes
from tests.support.api import Api
from tests.support.waiting import wait_for
from tests.support.workflow_env import WorkflowEnv

pytestmark = pytest.mark.integration

BOUNDARY = "calmqdeletionboundary"


# A partition of job_events or job_attempts (migration 0032) is its parent's: covered by
# the parent's line.
_NOT_A_PARTITION = ("NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.relname = table_name"
                    " AND c.relnamespace = current_schema()::regnamespace AND c.relispartition)")


def _tables_with_job_or_tenant_data(conn: psycopg.Connection[Any]) -> set[str]:
    rows = conn.execute(
        "SELECT DISTINCT table_name FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND column_name IN ('job_id', 'tenant_id') "
        f"AND {_NOT_A_PARTITION} UNION SELECT 'jobs'").fetchall()
    return {r[0] for r in rows}


def _all_tables(conn: psycopg.Connection[Any]) -> set[str]:
    rows = conn.execute("SELECT table_name FROM information_schema.tables "
                        "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
                        f" AND {_NOT_A_PARTITION}")
    return {r[0] for r in rows.fetchall()}


def test_every_table_with_job_or_tenant_data_is_covered_by_deletion(
        stack: StackState) -> None:
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"], autocommit=True) as conn:
        found = _tables_with_job_or_tenant_data(conn)
        tables = _all_tables(conn)
    missing = sorted(found - COVERAGE.keys())
    assert not missing, (
        f"tables {missing} hold job or tenant data but calmq.data.retention.COVERAGE does "
        "not say how a purge handles them")
    stale = sorted(COVERAGE.keys() - tables)
    assert not stale, f"COVERAGE names tables that do not exist: {stale}"


# -- the end-to-end purge ----------------------------------------------------------------------

class _Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def wf(stack: StackState) -> Iterator[WorkflowEnv]:
    env = WorkflowEnv(stack)
    try:
        yield env
    finally:
        env.close()


@pytest.fixture(scope="module")
def hooks_api(wf: WorkflowEnv) -> Api:
    """An API that accepts (and delivers to) a loopback callback: the webhook receiver."""
    port = processes.free_port()
    proc = wf.procs.start("api", "api", api_port=str(port), webhook_allow_private="true",
                          **wf.settings)
    wait_for(lambda: proc.poll() is not None or processes.port_open("127.0.0.1", port),
             timeout=30, what="the webhook-friendly API")
    assert proc.poll() is None, "the webhook-friendly API exited"
    return Api(f"http://127.0.0.1:{port}", wf.api.key)


@pytest.fixture(scope="module")
def receiver() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def _multipart(fields: dict[str, str], file: bytes) -> bytes:
    out = b""
    for name, value in fields.items():
        out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n"
                f"{value}\r\n").encode()
    out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            "filename=\"in.txt\"\r\nContent-Type: text/plain\r\n\r\n").encode()
    return out + file + f"\r\n--{BOUNDARY}--\r\n".encode()


def _rows_of(conn: psycopg.Connection[Any], table: str, job_ids: list[str]) -> list[str]:
    """Every covered row that belongs to the jobs, as text (all its columns)."""
    columns = {r[0] for r in conn.execute(
        "SELECT column_name FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name = %s", (table,)).fetchall()}
    if table == "jobs":
        where = "t.id = ANY(%(ids)s::uuid[])"
    elif "job_id" in columns:
        where = "t.job_id = ANY(%(ids)s::uuid[])"
    elif table == "webhook_attempts":
        where = ("t.delivery_id IN (SELECT id FROM webhook_deliveries "
                 "WHERE job_id = ANY(%(ids)s::uuid[]))")
    elif table == "outbox":
        where = "t.aggregateid = ANY(%(ids)s::text[])"
    elif "tenant_id" in columns:
        where = ("t.tenant_id IN (SELECT tenant_id FROM jobs WHERE id = ANY(%(ids)s::uuid[]))")
    elif table == "tenants":
        where = "t.id IN (SELECT tenant_id FROM jobs WHERE id = ANY(%(ids)s::uuid[]))"
    else:
        raise AssertionError(f"no way to find {table}'s rows of a job: add one here")
    rows = conn.execute(f"SELECT to_jsonb(t)::text FROM {table} t WHERE {where}",
                        {"ids": job_ids}).fetchall()
    return [r[0] for r in rows]


def _files_under(root: Path) -> list[Path]:
    return [Path(d) / f for d, _s, files in os.walk(root) for f in files]


def test_delete_leaves_no_text_and_no_object_of_the_job(
        wf: WorkflowEnv, hooks_api: Api, receiver: str) -> None:
    m = {k: f"mark-{k}-{uuid.uuid4().hex}" for k in
         ("upload", "meta", "hook", "idem", "embed", "invoice", "fix", "dead", "why",
          "draft")}
    api = wf.api
    # 1. summarize by multipart upload, with metadata, a webhook and an idempotency key.
    status, _h, body = hooks_api.call(
        "POST", "/v1/jobs", raw=_multipart(
            {"workflow": "summarize_t", "metadata": json.dumps({"note": m["meta"]}),
             "callback_url": f"{receiver}/hook/{m['hook']}"},
            f"Please summarize {m['upload']} for me.".encode()),
        headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
                 "Idempotency-Key": m["idem"]})
    assert status == 202, body
    summarized = str(body["job_id"])
    # 2. embed_document: chunk and vector objects under the tenant's prefix.
    embedded = wf.submit("embed_t", {"text": "\n\n".join(
        f"Paragraph {i} {m['embed']}: " + "word " * 30 for i in range(4)), "chunk_chars": 200})
    # 3. a reviewed invoice: model output, corrected fields, a ledger side effect.
    reviewed = wf.submit("invoice_t", {"text": f"Vendor: {m['invoice']}\nInvoice: 7?1\n"
                                               "Total: EUR 88.00\n", "mode": "low_confidence"})
    # 4. a dead letter, redriven into a second round that dies again.
    dead = wf.submit("summarize_t", {"text": f"garbage for {m['dead']}", "mode": "malformed"})
    # 5. a streamed draft: its text as chunks, then compacted (job_outputs).
    drafted = wf.submit("draft_t", {"prompt": f"draft {m['draft']}", "tokens": 20})
    jobs = [summarized, embedded, reviewed, dead, drafted]

    wf.wait_status(reviewed, "awaiting_review")
    status, _h, body = api.call("POST", f"/v1/jobs/{reviewed}/review", {
        "decision": "approve", "fields": {"invoice_number": m["fix"]}})
    assert status == 200, body
    assert wf.wait_status(dead, "completed", "dead_letter")["status"] == "dead_letter"
    status, _h, body = api.call("POST", f"/v1/dead-letters/{dead}/redrive",
                                {"reason": f"because {m['why']}"})
    assert status == 200, body
    wait_for(lambda: wf.sql("SELECT 1 FROM job_attempts WHERE job_id = %s", dead)
             and wf.job(dead)["status"] == "dead_letter", timeout=60,
             what="the redriven job to die again")
    for job_id in (summarized, embedded, reviewed, drafted):
        assert wf.wait_status(job_id, "completed", "dead_letter")["status"] == "completed"
    wait_for(lambda: wf.sql("SELECT 1 FROM webhook_attempts a JOIN webhook_deliveries d "
                            "ON d.id = a.delivery_id WHERE d.job_id = %s", summarized),
             timeout=30, what="the webhook to be tried")

    # What there is to find afterwards: every job's data, as it was.
    assert wf.sql("SELECT 1 FROM job_attempts_redriven WHERE job_id = %s", dead)
    assert wf.sql("SELECT 1 FROM side_effects WHERE job_id = %s AND response IS NOT NULL",
                  reviewed)
    assert wf.sql("SELECT 1 FROM idempotency_keys WHERE job_id = %s", summarized)
    assert wf.sql("SELECT 1 FROM job_output_chunks WHERE job_id = %s UNION ALL "
                  "SELECT 1 FROM job_outputs WHERE job_id = %s", drafted, drafted)
    errors = {r["error_message"] for r in wf.sql(
        "SELECT error_message FROM job_attempts WHERE job_id = ANY(%s::uuid[]) UNION "
        "SELECT record->>'error_message' FROM job_attempts_redriven "
        "WHERE job_id = ANY(%s::uuid[])", jobs, jobs) if r["error_message"]}
    assert errors, "the dead letter recorded no error message"
    outputs = [json.dumps(r["output"]) for r in wf.sql(
        "SELECT output FROM step_outputs WHERE job_id = ANY(%s::uuid[])", jobs)]
    accounting = wf.sql("SELECT id, status, input_tokens, output_tokens, cost_usd, created_at "
                        "FROM jobs WHERE id = ANY(%s::uuid[]) ORDER BY id", jobs)
    attempts = wf.sql("SELECT job_id, step, attempt, outcome, input_tokens, cost_usd "
                      "FROM job_attempts WHERE job_id = ANY(%s::uuid[]) "
                      "ORDER BY job_id, step, attempt", jobs)
    root = Path(unquote(urlparse(wf.stack.env["CALMQ_OBJECT_STORE_URL"]).path))
    tenant_files = _files_under(root / str(wf.tenant))
    mine = [p for p in tenant_files if any(j in str(p) for j in jobs)]
    assert any("chunks" in str(p) for p in mine)
    assert any("vectors" in str(p) for p in mine)
    input_ref = wf.sql("SELECT input_ref FROM jobs WHERE id = %s", summarized)[0]["input_ref"]
    assert input_ref
    assert Path(unquote(urlparse(input_ref).path)).exists()

    for job_id in jobs:
        status, _h, body = api.call("DELETE", f"/v1/jobs/{job_id}")
        assert status == 204, body

    # No text of the jobs left in any row of any table (the markers are nowhere else)...
    with psycopg.connect(wf.db, autocommit=True) as conn:
        for table in sorted(_all_tables(conn)):
            for marker in m.values():
                (hits,) = conn.execute(
                    f"SELECT count(*) FROM {table} t WHERE t::text LIKE %s",
                    (f"%{marker}%",)).fetchone() or (0,)
                assert hits == 0, f"{table} still holds {marker}"
        # ... nor their outputs or error messages in any covered row of theirs.
        covered = _tables_with_job_or_tenant_data(conn) | set(COVERAGE)
        for table in sorted(covered):
            for row in _rows_of(conn, table, jobs):
                for text in (*errors, *outputs):
                    if len(text) > 8:
                        assert text not in row, f"{table} still holds {text!r}: {row}"
    # No object left: not the upload, not the artifacts, not the chunks or the vectors.
    assert not Path(unquote(urlparse(input_ref).path)).exists()
    left = [p for p in _files_under(root / str(wf.tenant)) if any(j in str(p) for j in jobs)]
    assert left == []
    for path in tenant_files:
        assert not path.exists() or not any(
            mk.encode() in path.read_bytes() for mk in m.values()), path

    # What stays for accounting: the rows, statuses, times, tokens and costs.
    assert wf.sql("SELECT id, status, input_tokens, output_tokens, cost_usd, created_at "
                  "FROM jobs WHERE id = ANY(%s::uuid[]) ORDER BY id", jobs) == accounting
    assert wf.sql("SELECT job_id, step, attempt, outcome, input_tokens, cost_usd "
                  "FROM job_attempts WHERE job_id = ANY(%s::uuid[]) "
                  "ORDER BY job_id, step, attempt", jobs) == attempts
    # A purged dead letter has no input left to run: it is not redriven.
    status, _h, body = api.call("POST", f"/v1/dead-letters/{dead}/redrive",
                                {"reason": "again"})
    assert status == 409, body
    # And a repeat is harmless.
    assert api.call("DELETE", f"/v1/jobs/{summarized}")[0] == 204
