"""The batch lane against the real stack (Kafka, PostgreSQL) and the fake provider's batch
APIs, in the OpenAI and the Anthropic shape: batch-lane jobs end exactly as the same jobs
online (statuses, artifacts, reviews, dead letters) at half the cost; an expired batch's jobs
finish through a second batch or online; kill -9 of the batcher or the poller loses nothing
and creates no duplicate provider batch; a job refused for the lane gets a stable code. Spend
caps hold before the bill arrives (each packed request reserves its estimate), a workflow's
concurrency_limit holds, and a tenant's batch list is its own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from calmq import sql, topics
from calmq.data import NewJob, Store, insert_job
from calmq.data.spending import SpendLedger
from calmq.kafka import create_topics
from calmq.tooling.devstack import StackState, processes
from tests.support.api import Api
from tests.support.cli import calmq, new_tenant
from tests.support.keyed_workflows import LIMIT
from tests.support.waiting import wait_for
from tests.support.workers import BASE, Env, forwarded_env, history, metric

pytestmark = pytest.mark.integration

# The run is 1,000 jobs; BATCH_LANE_TEST_JOBS makes it smaller on a loaded laptop.
JOBS = int(os.environ.get("BATCH_LANE_TEST_JOBS", "1000"))
SETTLED = ("completed", "dead_letter", "cancelled", "awaiting_review")
MODES: list[dict[str, Any]] = [
    {"mode": "success"}, {"mode": "low_confidence"}, {"mode": "malformed"},
    {"mode": "refusal"}, {"mode": "bad_request"}, {"mode": "always_fail"},
    {"mode": "flaky", "fail_times": 1},
]
# Quick batches: packed for half a second, polled thrice a second; a 20 s "window" so that a
# job with a deadline a few seconds out is one another batch would miss.
LANE = {**BASE, "batch_max_age_seconds": "0.5", "batch_poll_interval_seconds": "0.3",
        "batch_lease_seconds": "3", "batch_completion_window_seconds": "20",
        "batch_deadline_margin_seconds": "0"}


@pytest.fixture(scope="module")
def env(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from forwarded_env(stack, tmp_path_factory.mktemp("batch-logs"))


@pytest.fixture(scope="module")
def fake(env: Env) -> str:
    """A fake provider of this module's own: batches end 1 s after they are created."""
    port = processes.free_port()
    proc = env.procs.start("fake", "fake-provider", "--port", str(port),
                           "--batch-completion-seconds", "1")
    url = f"http://127.0.0.1:{port}"
    # A deadline, not a pace: it starts in a second, but in over 30 s on a loaded machine.
    wait_for(lambda: proc.poll() is not None or _get(url + "/healthz") is not None,
             timeout=120, what="the fake provider")
    assert proc.poll() is None
    return url


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def _admin(url: str, **body: Any) -> dict[str, Any]:
    req = urllib.request.Request(url + "/admin/batches", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        result: dict[str, Any] = json.loads(resp.read())
        return result


def _pool(env: Env, name: str) -> str:
    pool = env.pool(name)
    create_topics(env.bootstrap, [topics.topic_for_route(topics.batch_route(pool))],
                  partitions=2)
    return pool


def _batcher(env: Env, pool: str, fake: str, provider: str = "openai", *,
             port: int | None = None, **settings: str) -> Any:
    port = port or processes.free_port()
    proc = env.procs.start("batcher", "batcher", "--pool", pool, "--metrics-port", str(port),
                           provider_url=fake, provider=provider, **{**LANE, **settings})
    # A deadline, not a pace: a process starts in seconds, but over 30 s on a loaded machine.
    wait_for(lambda: proc.poll() is not None or metric(port, "calmq_batches_open") is not None,
             timeout=90, what="the batcher's metrics endpoint")
    assert proc.poll() is None, f"batcher exited with {proc.returncode}"
    return proc


def _submit(env: Env, pool: str, inputs: list[dict[str, Any]], *, lane: str,
            deadline_at: datetime | None = None, tenant: uuid.UUID | None = None,
            workflow: str = "summarize", concurrency_key: str | None = None) -> list[str]:
    async def run() -> list[str]:
        store = Store(env.db, max_size=8)
        await store.open()
        try:
            async def one(data: dict[str, Any]) -> str:
                job = NewJob(id=uuid.uuid4(), tenant_id=tenant or env.tenant,
                             workflow=workflow,
                             workflow_version=1, priority="bulk", pool=pool, step="summarize",
                             max_attempts=3, input=data, deadline_at=deadline_at, lane=lane,
                             concurrency_key=concurrency_key)
                async with store.pool.connection() as conn:
                    await insert_job(conn, job)
                return str(job.id)

            out: list[str] = []
            for i in range(0, len(inputs), 100):
                out += await asyncio.gather(*(one(d) for d in inputs[i:i + 100]))
            return out
        finally:
            await store.close()

    return asyncio.run(run())


def _rows(db: str, ids: list[str]) -> dict[str, dict[str, Any]]:
    with psycopg.connect(db, row_factory=dict_row) as conn:
        rows = conn.execute(
            "SELECT id::text AS id, status, attempt, lane, errors, error, artifact, cost_usd, "
            "input_tokens, output_tokens FROM jobs WHERE id = ANY(%s::uuid[])",
            (ids,)).fetchall()
    return {r["id"]: r for r in rows}


def _settled(db: str, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    def check() -> dict[str, dict[str, Any]] | None:
        rows = _rows(db, ids)
        done = sum(r["status"] in SETTLED for r in rows.values())
        return rows if done == len(ids) else None

    result: dict[str, dict[str, Any]] = wait_for(check, timeout=timeout,
                                                 what=f"{len(ids)} jobs to settle")
    return result


def _batch_rows(db: str, pool: str) -> list[dict[str, Any]]:
    with psycopg.connect(db, row_factory=dict_row) as conn:
        return conn.execute("SELECT key, provider_id, state, request_count FROM "
                            "provider_batches WHERE pool = %s", (pool,)).fetchall()


def _custom_ids_at_fake(fake: str, ids: list[str]) -> Counter[str]:
    wanted = set(ids)
    stats = _get(fake + "/admin/batches")
    return Counter(c for c in stats["custom_ids"] if c.rpartition("_")[0] in wanted)


def _outcome(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["status"], row["attempt"], [e["code"] for e in row["errors"] or []],
            (row["error"] or {}).get("class"), (row["artifact"] or {}).get("sha256"))


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_batch_lane_jobs_end_as_the_same_jobs_online_at_half_the_cost(
        env: Env, fake: str, provider: str) -> None:
    """Mixed modes through the batch lane and online: the same status, attempts, error codes
    and classes, artifact bytes, review and dead letter per job; the batch cost is half the
    online cost of the same tokens."""
    pool = _pool(env, "bl" + provider[:2])
    # Leases long enough that a loaded machine does not expire them mid-call (which would
    # make the attempt cap dead-letter a job as poison on one side only).
    env.procs.worker(pool, provider_url=fake, provider=provider,
                     **{**BASE, "lease_seconds": "20"})
    # A provider window far longer than the run: a batch held past it would be requeued,
    # and on a loaded machine that can cost a job its attempts on the batch side only.
    _batcher(env, pool, fake, provider, lease_seconds="20",
             batch_completion_window_seconds="300")
    count = JOBS if provider == "openai" else max(len(MODES), JOBS // 4)
    inputs = [{"text": f"ticket {n}: the printer is on fire", **MODES[n % len(MODES)]}
              for n in range(count)]
    online = _submit(env, pool, inputs, lane="online")
    batch = _submit(env, pool, inputs, lane="batch")
    rows = _settled(env.db, online + batch, timeout=240)
    for n, (a, b) in enumerate(zip(online, batch, strict=True)):
        assert _outcome(rows[b]) == _outcome(rows[a]), (inputs[n], rows[a], rows[b],
                                                        history(env.db, a),
                                                        history(env.db, b))
        assert rows[b]["lane"] == "batch"
        assert rows[b]["input_tokens"] == rows[a]["input_tokens"]
        assert float(rows[b]["cost_usd"]) == pytest.approx(float(rows[a]["cost_usd"]) / 2, rel=1e-6)
    statuses = Counter(rows[b]["status"] for b in batch)
    assert statuses["completed"]
    assert statuses["awaiting_review"]
    assert statuses["dead_letter"]
    # Each job's history says which provider batch carried each of its attempts.
    first = history(env.db, batch[0])
    batched = [e for e in first if e["type"] == "batched"]
    assert batched
    assert batched[0]["detail"]["batch_id"]
    assert batched[0]["detail"]["provider"] == provider
    # No request went twice to the provider, and every batch is recorded.
    sent = _custom_ids_at_fake(fake, batch)
    assert sent
    assert max(sent.values()) == 1
    recorded = _batch_rows(env.db, pool)
    assert all(r["provider_id"] for r in recorded)
    assert {r["state"] for r in recorded} == {"collected"}


def test_an_expired_batch_finishes_through_a_second_batch_or_online(
        env: Env, fake: str) -> None:
    """The provider expires a batch: its jobs without a deadline go into a new batch; those
    whose deadline another batch would miss (20 s window here) continue online."""
    pool = _pool(env, "blexp")
    env.procs.worker(pool, provider_url=fake, **BASE)
    _batcher(env, pool, fake)
    _admin(fake, expire_next=1)
    waiting = _submit(env, pool, [{"text": f"backfill {n}"} for n in range(4)], lane="batch")
    urgent = _submit(env, pool, [{"text": f"urgent {n}"} for n in range(4)], lane="batch",
                     deadline_at=datetime.now(UTC) + timedelta(seconds=15))
    rows = _settled(env.db, waiting + urgent, timeout=90)
    assert _get(fake + "/admin/batches")["expire_next"] == 0
    for job_id in waiting + urgent:
        events = history(env.db, job_id)
        batches = [e["detail"]["batch_id"] for e in events if e["type"] == "batched"]
        codes = [e["code"] for e in rows[job_id]["errors"] or []]
        assert rows[job_id]["status"] == "completed", (job_id, events)
        if not codes:
            continue  # its batch was not the expired one
        assert codes == ["batch_expired"]
        assert rows[job_id]["attempt"] == 2
        if job_id in waiting:
            assert len(set(batches)) == 2
            assert rows[job_id]["lane"] == "batch"
        else:
            assert len(batches) == 1
            assert rows[job_id]["lane"] == "online"
    # One pack (submitted together, packed for 0.5 s): both kinds met the expired batch.
    assert {rows[j]["attempt"] for j in waiting} == {2}
    assert {rows[j]["lane"] for j in urgent} == {"online"}


# A batch holds its jobs for the completion window (20 s in LANE): a replacement batcher that
# takes longer than that to start on a loaded machine would find them lapsed and run them
# again (a second custom_id each). The kill tests are about the batch, not the window.
_LONG_HOLD = {"batch_completion_window_seconds": "600"}


def _kill(proc: Any) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_kill_9_of_the_batcher_loses_nothing_and_creates_no_duplicate_batch(
        env: Env, fake: str, provider: str) -> None:
    """The batcher is killed while it waits for the provider to answer a create (the batch
    exists there, calmq has not recorded its id): the next batcher adopts that batch (by its
    key in OpenAI's metadata; Anthropic's: the one unrecorded batch of its size since)."""
    pool = _pool(env, "blkb" + provider[:2])
    proc = _batcher(env, pool, fake, provider, **_LONG_HOLD)
    _admin(fake, create_delay_seconds=4)
    try:
        before = _get(fake + "/admin/batches")["batches"]
        ids = _submit(env, pool, [{"text": f"kill {n}"} for n in range(40)], lane="batch")
        wait_for(lambda: any(r["state"] == "creating" for r in _batch_rows(env.db, pool))
                 and _get(fake + "/admin/batches")["batches"] > before, timeout=60,
                 what="a batch created at the provider but not yet recorded")
        _kill(proc)
    finally:
        _admin(fake, create_delay_seconds=0)
    _batcher(env, pool, fake, provider, **_LONG_HOLD)
    rows = _settled(env.db, ids, timeout=90)
    assert {r["status"] for r in rows.values()} == {"completed"}
    sent = _custom_ids_at_fake(fake, ids)
    assert sum(sent.values()) == len(ids)
    assert max(sent.values()) == 1
    recorded = _batch_rows(env.db, pool)
    assert all(r["provider_id"] for r in recorded if r["state"] != "abandoned")
    assert len({r["provider_id"] for r in recorded}) == len(recorded)


def test_kill_9_of_the_poller_while_batches_are_open_loses_nothing(
        env: Env, fake: str) -> None:
    """Killed with batches open at the provider (and messages maybe uncommitted): another
    process collects them once the lease lapses; no job runs twice, no batch is duplicated."""
    pool = _pool(env, "blkp")
    proc = _batcher(env, pool, fake, **_LONG_HOLD)
    ids = _submit(env, pool, [{"text": f"poll {n}", "mode": ("success", "malformed")[n % 2]}
                              for n in range(120)], lane="batch")
    wait_for(lambda: any(r["state"] == "submitted" for r in _batch_rows(env.db, pool)),
             timeout=60, what="an open batch")
    _kill(proc)
    _batcher(env, pool, fake, **_LONG_HOLD)
    rows = _settled(env.db, ids, timeout=90)
    statuses = Counter(r["status"] for r in rows.values())
    assert statuses == {"completed": 60, "dead_letter": 60}
    sent = _custom_ids_at_fake(fake, ids)
    assert max(sent.values()) == 1
    # A batch is marked collected after its jobs' outcomes are written: waited for, not read
    # at once.
    def all_ended() -> list[dict[str, Any]] | None:
        rows = _batch_rows(env.db, pool)
        return rows if rows and {r["state"] for r in rows} <= {"collected", "abandoned"} else None

    recorded = wait_for(all_ended, timeout=60, what="every batch collected or abandoned")
    assert len({r["provider_id"] for r in recorded}) == len(recorded)


@pytest.mark.parametrize(("fields", "code"), [
    ({"lane": "batch", "deadline_seconds": 3600}, "deadline_too_short_for_batch"),
    ({"lane": "batch", "priority": "interactive"}, "batch_lane_needs_bulk"),
    ({"lane": "express"}, "invalid_body"),
])
def test_a_job_refused_for_the_batch_lane_gets_a_stable_code(
        env: Env, fields: dict[str, Any], code: str) -> None:
    status, _h, body = env.api.call("POST", "/v1/jobs", {
        "workflow": "summarize", "input": {"text": "x"}, **fields})
    assert status == 422, body
    assert body["code"] == code, body


def test_the_api_accepts_a_batch_lane_job_with_a_long_deadline(env: Env) -> None:
    status, _h, body = env.api.call("POST", "/v1/jobs", {
        "workflow": "summarize", "input": {"text": "x"}, "lane": "batch",
        "deadline_seconds": 2 * 24 * 3600})
    assert status == 202, body
    assert _rows(env.db, [body["job_id"]])[body["job_id"]]["lane"] == "batch"


def test_a_cancelled_job_leaves_its_pack_and_a_running_batch_s_result_is_ignored(
        env: Env, fake: str) -> None:
    """Cancelled while it waits in a pack: it is not sent. Cancelled once its batch runs at
    the provider: its result is ignored and the job stays cancelled."""
    pool = _pool(env, "blcan")
    _batcher(env, pool, fake, batch_max_age_seconds="3")
    _admin(fake, completion_seconds=4)
    try:
        packed, keep = _submit(env, pool, [{"text": "cancel me"}, {"text": "keep me"}],
                               lane="batch")
        wait_for(lambda: _rows(env.db, [packed])[packed]["status"] == "running", timeout=30,
                 what="the job claimed into a pack")
        status, _h, body = env.api.call("POST", f"/v1/jobs/{packed}/cancel")
        assert status in (200, 202), body
        (late,) = _submit(env, pool, [{"text": "cancel me late"}], lane="batch")
        wait_for(lambda: any(e["type"] == "batched" for e in history(env.db, late)),
                 timeout=30, what="the late job in a created batch")
        status, _h, body = env.api.call("POST", f"/v1/jobs/{late}/cancel")
        assert status in (200, 202), body
        rows = _settled(env.db, [packed, keep, late], timeout=60)
        assert rows[keep]["status"] == "completed"
        assert rows[packed]["status"] == "cancelled"
        assert rows[late]["status"] == "cancelled"
        wait_for(lambda: {r["state"] for r in _batch_rows(env.db, pool)} == {"collected"},
                 timeout=30, what="the late job's batch collected")
    finally:
        _admin(fake, completion_seconds=1)
    sent = _custom_ids_at_fake(fake, [packed, keep, late])
    assert packed not in {c.rpartition("_")[0] for c in sent}
    assert {c.rpartition("_")[0] for c in sent} == {keep, late}
    assert rows[late]["artifact"] is None
    assert not any(e["type"] == "completed" for e in history(env.db, late))


def _provider_files(fake: str, db: str, pool: str) -> set[str]:
    """Every file id the fake says the pool's OpenAI batches used (input, output, errors)."""
    files: set[str] = set()
    for row in _batch_rows(db, pool):
        view = _get(f"{fake}/v1/batches/{row['provider_id']}") if row["provider_id"] else None
        if view and "input_file_id" in view:
            files |= {view[k] for k in ("input_file_id", "output_file_id", "error_file_id")
                      if view.get(k)}
    return files


def _files_deleted(db: str, pool: str) -> bool:
    with psycopg.connect(db) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE files_deleted_at IS NULL), count(*) "
            "FROM provider_batches WHERE pool = %s AND provider_id IS NOT NULL",
            (pool,)).fetchone()
    assert row is not None
    return bool(row[1]) and row[0] == 0


def test_a_results_file_with_a_bad_line_and_a_50_mb_line_fails_only_those_requests(
        env: Env, fake: str) -> None:
    """The provider's results file has a line cut off mid-JSON and a line of 50 MB: the job
    the broken line names runs again in another batch and completes; the 50 MB one
    dead-letters as input (batch_result_too_large) unread; every other job completes at its
    first attempt. Once collected, no file of the pool's batches stays at the provider."""
    pool = _pool(env, "blbad")
    _batcher(env, pool, fake)
    _admin(fake, corrupt_next=True, huge_line_bytes=50 * 1024 * 1024)
    try:
        ids = _submit(env, pool, [{"text": f"line {n}"} for n in range(6)], lane="batch")
        rows = _settled(env.db, ids, timeout=120)
    finally:
        _admin(fake, corrupt_next=False)
    outcomes = Counter((r["status"], r["attempt"], tuple(e["code"] for e in r["errors"] or []),
                        (r["error"] or {}).get("class")) for r in rows.values())
    assert outcomes == {("completed", 2, ("batch_result_unreadable",), None): 1,
                        ("dead_letter", 1, ("batch_result_too_large",), "input"): 1,
                        ("completed", 1, (), None): 4}, rows
    wait_for(lambda: _files_deleted(env.db, pool), timeout=30,
             what="the collected batches' files deleted at the provider")
    files = _provider_files(fake, env.db, pool)
    assert files
    assert not files & set(_get(fake + "/admin/batches")["files"])


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_batch_failed_for_one_request_fails_that_job_only(
        env: Env, fake: str, provider: str) -> None:
    """One request the batch API's validation refuses fails the whole provider batch
    (OpenAI: the batch ends failed naming its line; Anthropic: the create is refused naming
    its index): that job dead-letters as input, as online; the other tenants' jobs of the
    batch complete through another batch with no attempt counted."""
    pool = _pool(env, "blinv" + provider[:2])
    _batcher(env, pool, fake, provider)
    modes = ["success", "invalid_line", "success", "success"]
    ids = _submit(env, pool, [{"text": f"req {n}", "mode": m} for n, m in enumerate(modes)],
                  lane="batch")
    rows = _settled(env.db, ids, timeout=120)
    bad = rows[ids[1]]
    assert (bad["status"], bad["attempt"], bad["error"]["class"]) == (
        "dead_letter", 1, "input"), history(env.db, ids[1])
    for job_id in (ids[0], *ids[2:]):
        row = rows[job_id]
        assert (row["status"], row["attempt"], row["errors"] or []) == (
            "completed", 1, []), history(env.db, job_id)


def test_a_deleted_batch_job_s_provider_files_are_gone(env: Env, fake: str) -> None:
    """A job cancelled and deleted while its batch runs at the provider: the batch, none of
    whose jobs waits any more, is cancelled there, and its input and result files are
    deleted at the provider."""
    pool = _pool(env, "bldel")
    _batcher(env, pool, fake)
    _admin(fake, completion_seconds=60)
    try:
        (job,) = _submit(env, pool, [{"text": "delete me"}], lane="batch")
        wait_for(lambda: any(e["type"] == "batched" for e in history(env.db, job)),
                 timeout=30, what="the job in a created batch")
        held = _provider_files(fake, env.db, pool)
        assert held
        assert held <= set(_get(fake + "/admin/batches")["files"])
        status, _h, body = env.api.call("POST", f"/v1/jobs/{job}/cancel")
        assert status in (200, 202), body
        status, _h, body = env.api.call("DELETE", f"/v1/jobs/{job}")
        assert status == 204, body
        wait_for(lambda: _files_deleted(env.db, pool), timeout=60,
                 what="the batch's files deleted at the provider")
    finally:
        _admin(fake, completion_seconds=1)
    assert {r["state"] for r in _batch_rows(env.db, pool)} == {"collected"}
    assert not _provider_files(fake, env.db, pool) & set(_get(fake + "/admin/batches")["files"])


def test_a_refused_key_pauses_the_batch_lane_and_no_attempt_is_counted(
        env: Env, fake: str) -> None:
    """The provider refuses the key (401) on its batch API: the provider is blocked, the
    batch lane's jobs wait queued for it with no attempt counted and nothing dead-lettered;
    once a probe call succeeds every job completes at its first attempt."""
    pool = _pool(env, "blkey")
    _batcher(env, pool, fake, provider_probe_seconds="1")

    def outage(seconds: float) -> None:
        req = urllib.request.Request(
            fake + "/admin/outage", method="POST",
            data=json.dumps({"seconds": seconds, "statuses": [401]}).encode(),
            headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()

    # The key stays refused until every job has been seen waiting for the provider (not
    # for a fixed time: on a loaded machine the first pack may take longer than any).
    outage(600)
    try:
        ids = _submit(env, pool, [{"text": f"key {n}"} for n in range(5)], lane="batch")
        wait_for(lambda: all("waiting" in [e["type"] for e in history(env.db, i)]
                             for i in ids), timeout=120, what="every job to wait for the key")
    finally:
        outage(0)
    rows = _settled(env.db, ids, timeout=120)
    for job_id, row in rows.items():
        events = history(env.db, job_id)
        assert (row["status"], row["attempt"], row["errors"] or []) == (
            "completed", 1, []), events
        # It waited for the provider (handed back uncounted), then was released.
        assert [e["type"] for e in events if e["type"] in ("waiting", "resumed")][:2] == [
            "waiting", "resumed"], events


def test_a_capped_tenants_batch_lane_jobs_wait_before_packing_and_resume_when_raised(
        stack: StackState, env: Env, fake: str) -> None:
    """A tenant past its daily spend cap: its batch-lane jobs wait queued with
    waiting_reason spend_cap_daily, no attempt and nothing sent to the provider (half price
    is still spend); raising the cap releases them to the batch lane, where they complete."""
    pool = _pool(env, "blcap")
    port = processes.free_port()
    _batcher(env, pool, fake, port=port, spend_cap_refresh_seconds="0.2")
    name, tenant, _key = new_tenant(stack, "blcap")
    (first,) = _submit(env, pool, [{"text": "what the day costs"}], lane="batch",
                       tenant=tenant)
    spent = float(_settled(env.db, [first], timeout=120)[first]["cost_usd"])
    assert spent > 0
    capped = calmq(stack, "tenants", "set-spend-cap", name, "--daily-usd", f"{spent / 2:.12f}")
    assert capped.returncode == 0, capped.stderr

    def held(job_id: str) -> bool:
        return ("waiting", {"reason": "spend_cap_daily"}) in [
            (e["type"], e["detail"]) for e in history(env.db, job_id)]

    # A cap holds within spend_cap_refresh_seconds of being set, but a read of the caps can
    # take longer than that on a loaded machine, and the capped-tenants gauge counts every
    # tenant (another one's cap taking hold raised it first in a CI run): a probe job shows
    # when this tenant's jobs are held. One the batcher packed before it read the cap runs,
    # and another probe follows it.
    probes = _submit(env, pool, [{"text": "probe 0"}], lane="batch", tenant=tenant)

    def cap_holds() -> bool:
        last = probes[-1]
        if held(last):
            return True
        if _rows(env.db, [last])[last]["status"] in ("completed", "dead_letter"):
            probes.extend(_submit(env, pool, [{"text": f"probe {len(probes)}"}], lane="batch",
                                  tenant=tenant))
        return False

    wait_for(cap_holds, timeout=90, what="the batcher to hold the capped tenant's jobs")
    ids = _submit(env, pool, [{"text": f"over the cap {n}"} for n in range(3)], lane="batch",
                  tenant=tenant)

    def waiting() -> bool:
        rows = _rows(env.db, ids)
        return all(r["status"] == "queued" for r in rows.values()) and all(
            held(i) for i in ids)

    wait_for(waiting, timeout=60, what="the capped tenant's batch-lane jobs to wait")
    assert all(r["attempt"] == 0 for r in _rows(env.db, ids).values())
    assert sum(_custom_ids_at_fake(fake, ids).values()) == 0

    raised = calmq(stack, "tenants", "set-spend-cap", name, "--daily-usd", "1")
    assert raised.returncode == 0, raised.stderr
    rows = _settled(env.db, ids, timeout=120)
    assert {r["status"] for r in rows.values()} == {"completed"}
    assert {r["lane"] for r in rows.values()} == {"batch"}
    assert sum(_custom_ids_at_fake(fake, ids).values()) == len(ids)


# -- spend caps hold before the bill, concurrency keys, the tenant's batch list (issue 42) --

def _reserved(db: str, ids: list[str]) -> dict[str, float]:
    """What each of these jobs' requests reserved against the spend caps when packed."""
    with psycopg.connect(db) as conn:
        rows = conn.execute("SELECT job_id::text, reserved_usd::float8 FROM batch_jobs "
                            "WHERE job_id = ANY(%s::uuid[])", (ids,)).fetchall()
    return {r[0]: r[1] for r in rows}


def _tenant_shares(db: str, tenant: uuid.UUID) -> list[dict[str, Any]]:
    with psycopg.connect(db, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT batch_key, requests, settled, retried, cancelled, cost_usd, "
            "reserved_usd::float8 AS reserved_usd FROM batch_tenants WHERE tenant_id = %s",
            (tenant,)).fetchall()


def _spent(db: str, tenant: uuid.UUID) -> float:
    """The tenant's month as the spend caps read it (spend, and open reservations)."""
    async def run() -> float:
        store = Store(db, max_size=1)
        await store.open()
        try:
            spend = (await SpendLedger(store).spend()).get(tenant)
            return spend.month if spend else 0.0
        finally:
            await store.close()

    return asyncio.run(run())


def test_a_capped_tenants_batch_burst_stops_at_the_cap_plus_at_most_one_pack(
        stack: StackState, env: Env) -> None:
    """A tenant far below its daily cap sends a burst of batch-lane jobs whose batches stay
    open (their results, and the bill, hours away): each packed request reserves its
    estimated cost, packing stops at the cap plus at most one pack, and the rest wait queued
    with the cap's reason, no attempt counted and nothing sent to the provider."""
    port = processes.free_port()
    slow = env.procs.start("fake", "fake-provider", "--port", str(port),
                           "--batch-completion-seconds", "3600")
    fake = f"http://127.0.0.1:{port}"
    # A deadline, not a pace: it starts in a second, but in over 30 s on a loaded machine.
    wait_for(lambda: slow.poll() is not None or _get(fake + "/healthz") is not None,
             timeout=120, what="the fake provider")
    assert slow.poll() is None
    pack = 5
    pool = _pool(env, "blburst")
    _batcher(env, pool, fake, spend_cap_refresh_seconds="0.2", batch_max_requests=str(pack))
    name, tenant, _key = new_tenant(stack, "blburst")
    # What one request reserves: the first job's, packed before any cap (equal inputs,
    # equal estimates).
    (first,) = _submit(env, pool, [{"text": "burst 000"}], lane="batch", tenant=tenant)
    estimate = wait_for(lambda: _reserved(env.db, [first]).get(first), timeout=60,
                        what="the first request to be packed")
    assert estimate > 0
    cap = 12 * estimate
    capped = calmq(stack, "tenants", "set-spend-cap", name, "--daily-usd", f"{cap:.12f}")
    assert capped.returncode == 0, capped.stderr
    burst = _submit(env, pool, [{"text": f"burst {n:03}"} for n in range(1, 61)],
                    lane="batch", tenant=tenant)

    def settled_down() -> dict[str, dict[str, Any]] | None:
        rows = _rows(env.db, burst)
        packed = _reserved(env.db, burst)
        waiting = [i for i, r in rows.items() if r["status"] == "queued" and i not in packed]
        with psycopg.connect(env.db) as conn:
            held = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s::uuid[]) AND "
                                "waiting_reason = 'spend_cap_daily'", (burst,)).fetchone()
        done = held is not None and held[0] == len(waiting) and (
            len(packed) + len(waiting) == len(burst))
        return rows if done else None

    rows = wait_for(settled_down, timeout=180, what="the burst to be packed or held")
    packed = _reserved(env.db, burst)
    reserved = estimate + sum(packed.values())
    assert packed, "nothing of the burst was packed"
    assert len(packed) < len(burst), "the whole burst was packed past the cap"
    assert reserved <= cap + pack * estimate * 1.0001, (reserved, cap)
    # The spend caps count what is reserved, and the tenant's shares hold it.
    assert _spent(env.db, tenant) == pytest.approx(reserved, rel=1e-6)
    assert sum(s["reserved_usd"] for s in _tenant_shares(env.db, tenant)) == pytest.approx(
        reserved, rel=1e-6)
    held = [i for i in burst if i not in packed]
    assert all(rows[i]["status"] == "queued" and rows[i]["attempt"] == 0 for i in held)
    assert all(("waiting", "spend_cap_daily") in [
        (e["type"], e["detail"].get("reason")) for e in history(env.db, i)] for i in held)
    assert sum(_custom_ids_at_fake(fake, held).values()) == 0


def test_batch_results_settle_the_reservation_with_the_real_cost(
        stack: StackState, env: Env, fake: str) -> None:
    """After a batch's results (one batch expired first: its jobs went into a second
    batch), the tenant's recorded spend equals the jobs' real cost and nothing is reserved
    any more; each request had reserved its estimate when packed."""
    pool = _pool(env, "blsettle")
    _batcher(env, pool, fake)
    name, tenant, _key = new_tenant(stack, "blsettle")
    capped = calmq(stack, "tenants", "set-spend-cap", name, "--daily-usd", "5")
    assert capped.returncode == 0, capped.stderr
    _admin(fake, expire_next=1)
    ids = _submit(env, pool, [{"text": f"settle {n}"} for n in range(4)], lane="batch",
                  tenant=tenant)
    rows = _settled(env.db, ids, timeout=120)
    assert {r["status"] for r in rows.values()} == {"completed"}
    assert {r["attempt"] for r in rows.values()} == {2}  # through the expired batch first
    cost = sum(float(r["cost_usd"]) for r in rows.values())
    assert cost > 0

    def released() -> list[dict[str, Any]] | None:
        shares = _tenant_shares(env.db, tenant)
        return shares if len(shares) == 2 and all(
            s["reserved_usd"] == 0 for s in shares) else None

    shares = wait_for(released, timeout=60, what="the reservations to be settled")
    assert sorted((s["settled"], s["retried"]) for s in shares) == [(0, 4), (4, 0)]
    assert sum(s["cost_usd"] for s in shares) == pytest.approx(cost, rel=1e-6)
    assert _spent(env.db, tenant) == pytest.approx(cost, rel=1e-6)
    assert all(v > 0 for v in _reserved(env.db, ids).values())


def test_the_batch_lane_honours_a_workflows_concurrency_limit(env: Env, fake: str) -> None:
    """Jobs of one concurrency key on a workflow with concurrency_limit 2, all at once on
    the batch lane: no batch carries more than 2 of them and never more than 2 are in open
    batches; the others wait for their key and all complete."""
    pool = _pool(env, "blkey")
    keyed = {"workflow_modules": "tests.support.keyed_workflows"}
    _batcher(env, pool, fake, **keyed)
    # The fleet's concurrency-key release pass (here `calmq reaper`, as in a fleet whose
    # workers are scaled to zero) re-publishes the held jobs as the key's jobs settle.
    env.procs.start("reaper", "reaper", **BASE, **keyed)
    ids = _submit(env, pool, [{"text": f"customer work {n}"} for n in range(6)],
                  lane="batch", workflow="summarize_keyed", concurrency_key="cust-1")
    rows = _settled(env.db, ids, timeout=180)
    assert {r["status"] for r in rows.values()} == {"completed"}
    with psycopg.connect(env.db, row_factory=dict_row) as conn:
        spans = conn.execute(
            "SELECT b.key, b.created_at, b.collected_at, count(*) AS n FROM batch_jobs bj "
            "JOIN provider_batches b ON b.key = bj.batch_key "
            "WHERE bj.job_id = ANY(%s::uuid[]) GROUP BY b.key", (ids,)).fetchall()
    assert max(s["n"] for s in spans) <= LIMIT, spans
    for s in spans:  # the key's jobs in batches open at the moment this one was created
        open_then = sum(o["n"] for o in spans if o["created_at"] <= s["created_at"]
                        and (o["collected_at"] is None or o["collected_at"] > s["created_at"]))
        assert open_then <= LIMIT, spans
    assert any(("waiting", "concurrency_key") in [
        (e["type"], e["detail"].get("reason")) for e in history(env.db, i)] for i in ids)


def test_get_batches_lists_only_the_tenants_own_batches_a_page_at_a_time(
        stack: StackState, env: Env, fake: str) -> None:
    """Two tenants' jobs in batches (a batch each, then one batch holding both): each
    tenant's GET /v1/batches lists, newest first and a page at a time, exactly the batches
    holding its jobs, with its own share of the shared one; the other's batch is not
    there, nor found by its id."""
    pool = _pool(env, "bllist")
    _batcher(env, pool, fake)
    api = stack.env["CALMQ_API_URL"]
    _na, a, key_a = new_tenant(stack, "bllista")
    _nb, b, key_b = new_tenant(stack, "bllistb")
    only_a = _submit(env, pool, [{"text": "a alone"}], lane="batch", tenant=a)
    _settled(env.db, only_a, timeout=120)
    only_b = _submit(env, pool, [{"text": "b alone"}], lane="batch", tenant=b)
    _settled(env.db, only_b, timeout=120)
    both = (_submit(env, pool, [{"text": "a shared 1"}, {"text": "a shared 2"}],
                    lane="batch", tenant=a)
            + _submit(env, pool, [{"text": "b shared"}], lane="batch", tenant=b))
    _settled(env.db, both, timeout=120)

    def carried(ids: list[str]) -> set[str]:
        with psycopg.connect(env.db) as conn:
            return {r[0] for r in conn.execute(
                "SELECT DISTINCT batch_key::text FROM batch_jobs WHERE job_id = ANY(%s::uuid[])",
                (ids,)).fetchall()}

    def pages(key: str) -> list[dict[str, Any]]:
        client, seen, cursor = Api(api, key), [], ""
        while True:
            status, _h, body = client.call("GET", f"/v1/batches?limit=1{cursor}")
            assert status == 200, body
            assert len(body["batches"]) <= 1
            seen += body["batches"]
            if body["next_cursor"] is None:
                return seen
            cursor = f"&cursor={body['next_cursor']}"

    def own(batch_key: str, ids: list[str]) -> int:
        with psycopg.connect(env.db) as conn:
            row = conn.execute("SELECT count(*) FROM batch_jobs WHERE batch_key = %s AND "
                               "job_id = ANY(%s::uuid[]) AND state = 'settled'",
                               (batch_key, ids)).fetchone()
        return int(row[0]) if row else 0

    mine_a, mine_b = carried(only_a + both[:2]), carried(only_b + both[2:])
    listed_a, listed_b = pages(key_a), pages(key_b)
    assert {x["key"] for x in listed_a} == mine_a
    assert {x["key"] for x in listed_b} == mine_b
    assert len(listed_a) == len(mine_a)  # no page repeats one
    stamps = [x["created_at"] for x in listed_a]
    assert stamps == sorted(stamps, reverse=True)  # newest first
    for batch in listed_a:  # the tenant's own share: its requests, its counts
        n = own(batch["key"], only_a + both[:2])
        assert batch["request_count"] == n, batch
        assert batch["counts"] == {"settled": n}, batch
    (b_alone,) = carried(only_b) - mine_a
    status, _h, _body = Api(api, key_a).call("GET", f"/v1/batches/{b_alone}")
    assert status == 404
    for one in mine_a & mine_b:  # shared: each sees its own share of it
        status, _h, body = Api(api, key_b).call("GET", f"/v1/batches/{one}")
        assert status == 200, body
        assert body["request_count"] == own(one, both[2:]), body


def test_the_tenants_batch_list_reads_its_own_rows(stack: StackState) -> None:
    """GET /v1/batches's statement starts from the tenant's own shares (an index of
    batch_tenants): no sequential read of provider_batches, batch_jobs or batch_tenants,
    and no read of batch_jobs at all (seq scans priced out)."""
    statement = sql.queries()["batch_list_tenant"]
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(r[0] for r in conn.execute(b"EXPLAIN " + statement.encode(), {
            "tenant_id": uuid.uuid4(), "state": None, "limit": 51,
            "cursor_at": datetime.now(UTC), "cursor_key": uuid.uuid4()}).fetchall())
    assert "batch_tenants_list" in plan, plan
    assert "Seq Scan" not in plan, plan
    assert "batch_jobs" not in plan, plan
