"""A number that is not finite (``1e999``) in a model's answer: the job fails its step as a
verifier failure (``malformed_output``) at once, through the real stack, instead of an
outcome no row can hold (jsonb refuses infinity) being lost or retried."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from calmq.data import NewJob, Store, insert_job
from calmq.tooling.devstack import StackState
from tests.support.waiting import wait_for
from tests.support.workers import BASE, Env, forwarded_env, history, job_rows

pytestmark = pytest.mark.integration

# What the provider stand-in answers every call with: the invoice fields, with a total that
# Python's JSON parser reads as infinity.
ANSWER = ('{"vendor": "ACME GmbH", "invoice_number": "2024-17", "total": 1e999, '
          '"currency": "EUR", "confidence": 0.99}')


class _StandIn(BaseHTTPRequestHandler):
    """An OpenAI-shaped Chat Completions endpoint that answers ANSWER to every call."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({
            "id": "chatcmpl-nonfinite", "object": "chat.completion", "created": 0,
            "model": "gpt-4o-mini",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": ANSWER}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        return None


@pytest.fixture(scope="module")
def env(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from forwarded_env(stack, tmp_path_factory.mktemp("non-finite-logs"))


@pytest.fixture(scope="module")
def stand_in() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _submit_invoice(env: Env, pool: str) -> str:
    async def run() -> str:
        store = Store(env.db, max_size=2)
        await store.open()
        try:
            job = NewJob(id=uuid.uuid4(), tenant_id=env.tenant, workflow="invoice_s",
                         workflow_version=1, priority="interactive", pool=pool,
                         step="extract_text", max_attempts=3,
                         input={"text": "Vendor: ACME GmbH\nTotal: EUR 120.50\n"})
            async with store.pool.connection() as conn:
                await insert_job(conn, job)
            return str(job.id)
        finally:
            await store.close()

    return asyncio.run(run())


def test_1e999_in_a_models_answer_is_malformed_output_not_a_lost_outcome(
        env: Env, stand_in: str) -> None:
    """The model answers a total of 1e999: the job is dead-lettered at its first attempt
    with class verifier, code malformed_output, and its history says so."""
    pool = env.pool("nonfinite")
    env.procs.worker(pool, **BASE, workflow_modules="tests.support.shape_workflows",
                     ledger_url="http://127.0.0.1:9/ledger", provider="openai",
                     provider_url=stand_in, model="gpt-4o-mini")
    job_id = _submit_invoice(env, pool)
    row = wait_for(lambda: (r := job_rows(env.db, [job_id])[job_id])["status"] in (
        "completed", "dead_letter", "awaiting_review", "cancelled") and r, timeout=90,
        what="the invoice job to settle")
    assert row["status"] == "dead_letter", row
    assert (row["error"]["code"], row["error"]["class"]) == ("malformed_output", "verifier")
    assert row["attempt"] == 1
    assert "dead_lettered" in [e["type"] for e in history(env.db, job_id)]
