"""Every built-in workflow against the strict fake provider (it refuses what the real APIs
refuse), in the OpenAI and the Anthropic shape, online and through the batch lane: every job
completes, a low-confidence invoice still reaches review under strict structured outputs,
and the fake refused nothing. Anthropic runs chat; embed_document's embeddings go to an
OpenAI-shaped embeddings provider of their own."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from calmq import topics
from calmq.data import NewJob, Store, insert_job
from calmq.kafka import create_topics
from calmq.tooling.devstack import StackState, processes
from tests.support.ledger import Ledger
from tests.support.waiting import wait_for
from tests.support.workers import BASE, Env, fake_stats, forwarded_env, job_rows, metric

pytestmark = pytest.mark.integration

INVOICE = "Vendor: ACME GmbH\nInvoice: 2024-17\nTotal: EUR 120.50\n"
MODELS = {"openai": "gpt-4o-mini", "anthropic": "claude-sonnet-4-5"}
FIRST_STEP = {"summarize_s": "summarize", "invoice_s": "extract_text", "embed_s": "chunk"}


@pytest.fixture(scope="module")
def env(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from forwarded_env(stack, tmp_path_factory.mktemp("shape-logs"))


@pytest.fixture(scope="module")
def ledger() -> Iterator[Ledger]:
    book = Ledger().start()
    try:
        yield book
    finally:
        book.stop()


@pytest.fixture(scope="module")
def fake(env: Env) -> str:
    """A strict fake provider of this module's own: batches end 1 s after creation."""
    port = processes.free_port()
    proc = env.procs.start("fake", "fake-provider", "--port", str(port),
                           "--batch-completion-seconds", "1",
                           "--requests-per-minute", "100000")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: proc.poll() is not None or _healthy(url), timeout=90,
             what="the fake provider")
    assert proc.poll() is None
    return url


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2):
            return True
    except OSError:
        return False


def _submit(env: Env, pool: str, jobs: list[tuple[str, dict[str, Any], str]]) -> list[str]:
    async def run() -> list[str]:
        store = Store(env.db, max_size=4)
        await store.open()
        try:
            ids = []
            for workflow, data, lane in jobs:
                job = NewJob(id=uuid.uuid4(), tenant_id=env.tenant, workflow=workflow,
                             workflow_version=1, priority="bulk", pool=pool,
                             step=FIRST_STEP[workflow], max_attempts=3, input=data,
                             lane=lane)
                async with store.pool.connection() as conn:
                    await insert_job(conn, job)
                ids.append(str(job.id))
            return ids
        finally:
            await store.close()

    return asyncio.run(run())


@pytest.mark.parametrize("shape", ["openai", "anthropic"])
def test_every_builtin_workflow_completes_against_the_strict_fake(
        env: Env, fake: str, ledger: Ledger, shape: str) -> None:
    """Online and batch lane, in this provider's shape: each built-in workflow completes,
    the low-confidence invoice waits in review, and the fake refused no request."""
    pool = env.pool("shape" + shape[:2])
    create_topics(env.bootstrap, [topics.topic_for_route(topics.batch_route(pool))],
                  partitions=2)
    settings = {**BASE, "lease_seconds": "20",
                "workflow_modules": "tests.support.shape_workflows",
                "ledger_url": ledger.url, "provider": shape, "provider_url": fake,
                "model": MODELS[shape], "embeddings_provider": "openai",
                "embeddings_url": fake, "embeddings_model": "text-embedding-3-small",
                "batch_max_age_seconds": "0.5", "batch_poll_interval_seconds": "0.3",
                "batch_lease_seconds": "20", "batch_completion_window_seconds": "300",
                "batch_deadline_margin_seconds": "0"}
    env.procs.worker(pool, **settings)
    port = processes.free_port()
    batcher = env.procs.start("batcher", "batcher", "--pool", pool, "--metrics-port",
                              str(port), **settings)
    wait_for(lambda: batcher.poll() is not None or metric(port, "calmq_batches_open")
             is not None, timeout=60, what="the batcher")
    assert batcher.poll() is None
    online = _submit(env, pool, [
        ("summarize_s", {"text": "A long text about queues and retries."}, "online"),
        ("invoice_s", {"text": INVOICE}, "online"),
        ("embed_s", {"text": "Paragraph one.\n\nParagraph two. " * 40, "chunk_chars": 200},
         "online"),
    ])
    [review] = _submit(env, pool, [("invoice_s", {"text": INVOICE,
                                                  "mode": "low_confidence"}, "online")])
    batched = _submit(env, pool, [
        ("summarize_s", {"text": f"Batched text {n} about queues."}, "batch")
        for n in range(3)] + [("invoice_s", {"text": INVOICE}, "batch")])
    wanted = {**dict.fromkeys(online + batched, "completed"), review: "awaiting_review"}

    def settled() -> dict[str, Any] | dict[str, str]:
        rows = job_rows(env.db, list(wanted))
        done = all(rows[j]["status"] in ("completed", "dead_letter", "awaiting_review",
                                         "cancelled") for j in wanted)
        return rows if done else {}

    rows = wait_for(settled, timeout=240, what="every job to settle")
    assert {j: rows[j]["status"] for j in wanted} == wanted, {
        j: (rows[j]["status"], rows[j]["error"]) for j in wanted}
    summary = rows[online[0]]["artifact"]
    assert summary is not None
    stats = fake_stats(fake)
    assert (stats["refused"], stats["refusals"]) == (0, [])
    # The invoice's fields were posted to the ledger, once, in this shape too.
    assert ledger.for_job(online[1])
    with urllib.request.urlopen(fake + "/admin/calls", timeout=10) as resp:
        calls = json.loads(resp.read())["calls"]
    # embed_document's batches are its child jobs (embed_batch, on its pool): theirs too
    with psycopg.connect(env.db) as conn:
        children = {str(r[0]) for r in conn.execute(
            "SELECT id FROM jobs WHERE parent_id = ANY(%s::uuid[])", (list(wanted),))}
    paths = {c["path"] for c in calls if c["job"] in wanted or c["job"] in children}
    assert ("/v1/messages" if shape == "anthropic" else "/v1/chat/completions") in paths
    assert "/v1/embeddings" in paths
