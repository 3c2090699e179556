"""Failures read the way the providers mean them, on the real stack: a revoked key or
exhausted billing pauses the provider fleet-wide with no attempt counted and nothing
dead-lettered; a firewall's 403 to one tenant's prompt is that job's own failure and blocks
no one; a job whose own call meets a confirmed block again ends in dead letter; a rate
limit's retry-after-ms holds every worker, and `calmq provider unpause` lifts a long one; a
context-length error is the job's input. Each test runs a fake provider of its own (an
outage must not reach the other tests) behind real workers, Kafka and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import psycopg
import pytest
from aiohttp import web
from psycopg.rows import dict_row

from calmq.tooling.devstack import StackState, processes
from tests.support.cli import calmq, calmq_env
from tests.support.waiting import wait_for
from tests.support.workers import (
    BASE,
    Env,
    Procs,
    create_pool_topics,
    create_tenant_id,
    fake_stats,
    job_rows,
    submit,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TIERS = "1s,2s,4s"


@pytest.fixture
def env(stack: StackState, tmp_path: Path) -> Iterator[Env]:
    procs = Procs(stack.env, tmp_path / "logs")
    create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], "unused", TIERS.split(","))
    procs.forwarder(retry_tiers=TIERS)
    try:
        yield Env(stack, procs)
    finally:
        procs.stop_all()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[str]:
    """A fake provider of this test's own (its outages stay here)."""
    port = processes.free_port()
    log = open(tmp_path / "fake-provider.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "calmq.cli", "fake-provider", "--port", str(port),
         "--retry-after-seconds", "1.2"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ok(url), timeout=90, what="the test's fake provider")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2):
            return True
    except OSError:
        return False


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def _counts(db: str, ids: list[str]) -> dict[str, Any]:
    with psycopg.connect(db, row_factory=dict_row) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'completed') AS completed,"
            " count(*) FILTER (WHERE status = 'dead_letter') AS dead,"
            " count(*) FILTER (WHERE waiting_reason = 'provider_blocked') AS waiting,"
            " coalesce(max(attempt), 0) AS max_attempt,"
            " (SELECT count(*) FROM job_attempts a WHERE a.job_id = ANY(%s::uuid[])) AS tries"
            " FROM jobs WHERE id = ANY(%s::uuid[])", (ids, ids)).fetchone()
    assert row is not None
    return dict(row)


class Firewall:
    """A web application firewall in front of a provider, as in front of Azure OpenAI or a
    gateway: a request whose body holds a SQL-injection-looking string gets its 403 page
    (HTML, not the provider's JSON error); every other request is passed to ``upstream``
    and its answer back. Runs its own event loop in a thread, beside the sync test."""

    MARK = b"OR 1=1"

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.refused = 0
        self.passed = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="firewall",
                                        daemon=True)
        self._thread.start()
        port = processes.free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        asyncio.run_coroutine_threadsafe(self._start(port), self._loop).result(30)

    def __enter__(self) -> Firewall:
        return self

    def __exit__(self, *_exc: type[BaseException] | BaseException | TracebackType | None
                 ) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self, port: int) -> None:
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if self.MARK in body:
            self.refused += 1
            return web.Response(status=403, content_type="text/html",
                                text="<html><body><h1>403 Forbidden</h1><p>Request blocked "
                                     "by the web application firewall.</p></body></html>")
        self.passed += 1
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type", "api-key", "x-api-key",
                                    "anthropic-version")}
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         data=body, headers=headers) as resp:
            answer = await resp.read()
            kept = {k: v for k, v in resp.headers.items()
                    if k.lower() in ("content-type", "retry-after", "retry-after-ms")
                    or k.lower().startswith("x-ratelimit-")}
            return web.Response(status=resp.status, body=answer, headers=kept)


def _blocked_waits(db: str, ids: list[str]) -> list[dict[str, Any]]:
    """The jobs' waits for a blocked provider (their `waiting` events of that reason)."""
    with psycopg.connect(db, row_factory=dict_row) as conn:
        return conn.execute("SELECT job_id::text AS job_id, attempt, detail FROM job_events"
                            " WHERE job_id = ANY(%s::uuid[]) AND type = 'waiting'"
                            " AND detail->>'reason' = 'provider_blocked' ORDER BY id",
                            (ids,)).fetchall()


def _provider_states(db: str, url: str) -> list[dict[str, Any]]:
    with psycopg.connect(db, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT provider, model, blocked_reason,"
            " greatest(0, extract(epoch FROM paused_until - clock_timestamp()))::float8"
            " AS paused_seconds FROM provider_states"
            # the provider key: kind:URL, then #key- and the key's fingerprint
            " WHERE substr(split_part(provider, '#key-', 1), position(':' IN provider) + 1)"
            " = %s", (url,)).fetchall()


def _worker_settings(fake: str, **more: str) -> dict[str, str]:
    return {**BASE, "retry_tiers": TIERS, "provider_url": fake, "provider_probe_seconds": "2",
            "step_timeout_seconds": "20", **more}


def _blocked_reason(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("calmq_provider_blocked{") and line.endswith(" 1.0"):
            return line.split('reason="', 1)[1].split('"', 1)[0]
    return None


def _health(env: Env) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "calmq.cli", "health", "-o", "json"], check=False,
                         env={**_clean_env(), **env.stack.env}, capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}


def test_a_revoked_key_pauses_the_fleet_and_every_job_completes_after(
        env: Env, fake: str) -> None:
    """1,000 jobs while the provider answers 401 for 60 s: none dead-lettered, no attempt
    counted against them, the blocked metric and `calmq health` name invalid_api_key during
    the outage, and every job completes once the key works again."""
    pool = env.pool("revoked")
    _, port = env.procs.worker(pool, **_worker_settings(fake, concurrency="64"))
    _post(fake + "/admin/outage", {"seconds": 60, "statuses": [401]})
    ids = env.submit(pool, *({"text": f"job {n} text"} for n in range(1000)), priority="bulk")
    wait_for(lambda: _blocked_reason(port) == "invalid_api_key", timeout=60,
             what="the worker's calmq_provider_blocked{reason=invalid_api_key}")
    providers = next(r for r in _health(env) if r["part"] == "providers")
    assert providers["status"] == "DOWN"
    assert "invalid_api_key" in providers["reason"]
    during = wait_for(lambda: (c := _counts(env.db, ids))["waiting"] >= 900 and c,
                      timeout=60, what="the jobs to wait for the blocked provider")
    # Attempts in flight have a row until their hand-back removes it; none accumulates.
    assert (during["dead"], during["completed"]) == (0, 0)
    assert during["max_attempt"] <= 1
    done = wait_for(lambda: (c := _counts(env.db, ids))["completed"] == 1000 and c,
                    timeout=150, what="every job to complete after the outage")
    # One attempt each, the one that succeeded: the outage counted none.
    assert (done["dead"], done["max_attempt"], done["tries"]) == (0, 1, 1000)
    assert _blocked_reason(port) is None
    assert fake_stats(fake)["refused"] == 0


def test_insufficient_quota_pauses_and_context_length_is_the_jobs_input(
        env: Env, fake: str) -> None:
    """Exhausted billing pauses like a bad key (no dead letter, no attempt counted); a
    context-length error dead-letters as input at the first attempt."""
    pool = env.pool("quota")
    env.procs.worker(pool, **_worker_settings(fake))
    _post(fake + "/admin/outage", {"seconds": 5, "statuses": ["insufficient_quota"]})
    ids = env.submit(pool, *({"text": f"quota {n}"} for n in range(20)), priority="bulk")
    done = wait_for(lambda: (c := _counts(env.db, ids))["completed"] == 20 and c,
                    timeout=90, what="the jobs to complete after the billing outage")
    assert (done["dead"], done["max_attempt"], done["tries"]) == (0, 1, 20)
    [long] = env.submit(pool, {"text": "too long", "mode": "context_length"})
    job = env.finished(long)
    assert job["status"] == "dead_letter"
    assert (job["error"]["code"], job["error"]["class"], job["attempt"]) == (
        "context_length_exceeded", "input", 1)


def test_retry_after_ms_holds_every_worker(env: Env, fake: str) -> None:
    """A 429 with retry-after-ms 1200: no call reaches that provider and model for 1.2 s,
    from either of two workers (the pause is fleet-wide)."""
    pool = env.pool("ratelimit")
    settings = _worker_settings(fake, concurrency="8")
    env.procs.worker(pool, **settings)
    env.procs.worker(pool, **settings)
    steady = env.submit(pool, *({"text": f"steady {n}", "delay_ms": 100} for n in range(150)),
                        priority="bulk")
    wait_for(lambda: fake_stats(fake)["calls"] >= 20, timeout=60,
             what="calls from both workers")
    [limited] = env.submit(pool, {"text": "limited", "mode": "rate_limited"},
                           max_attempts=1)
    env.finished(limited)
    for job_id in steady:
        env.finished(job_id, timeout=120)
    with urllib.request.urlopen(fake + "/admin/calls", timeout=10) as resp:
        calls = json.loads(resp.read())["calls"]
    first_429 = min(c["at"] for c in calls if c["job"] == limited)
    # Calls a worker had sent before the pause reached it (a few ms over LISTEN/NOTIFY)
    # arrive within the grace; from then until 1.2 s after the 429 none may.
    grace = 0.1
    during = [c for c in calls if first_429 + grace < c["at"] < first_429 + 1.2]
    assert during == []
    after = [c for c in calls if c["at"] >= first_429 + 1.2]
    assert after  # the workers went on once the wait was over
    rows = job_rows(env.db, steady)
    assert all(r["status"] == "completed" for r in rows.values())


def test_a_firewalls_403_to_one_tenants_prompt_ends_that_job_and_blocks_no_one(
        env: Env, fake: str) -> None:
    """A firewall before the provider answers 403 to one tenant's prompt holding "' OR 1=1
    --": that job ends in dead_letter (provider_permission, its first attempt, one refused
    call), while another tenant's 20 jobs complete promptly, none handed back, and the
    model is never blocked (the probe call went through the firewall)."""
    with Firewall(fake) as waf:
        pool = env.pool("waf")
        env.procs.worker(pool, **_worker_settings(waf.url, concurrency="16"))
        other, _key = create_tenant_id(env.db, f"waf-other-{uuid.uuid4().hex[:8]}")
        warm = submit(env.db, other, pool, [{"text": "warm up"}], priority="bulk")
        wait_for(lambda: _counts(env.db, warm)["completed"] == 1, timeout=90,
                 what="a first job: the worker and the provider are warm")
        [hostile] = env.submit(pool, {"text": "Robert'); SELECT * FROM users WHERE name = "
                                              "'' OR 1=1 --"}, priority="bulk")
        started = time.monotonic()
        ids = submit(env.db, other, pool, [{"text": f"ordinary {n}"} for n in range(20)],
                     priority="bulk")
        done = wait_for(lambda: (c := _counts(env.db, ids))["completed"] == 20 and c,
                        timeout=60, what="the other tenant's 20 jobs")
        took = time.monotonic() - started
        job = env.finished(hostile, timeout=60)
        refused = waf.refused
    assert job["status"] == "dead_letter"
    assert (job["error"]["code"], job["error"]["class"], job["attempt"]) == (
        "provider_permission", "permission", 1)
    assert refused == 1  # sent once: never handed back and sent again
    assert (done["dead"], done["max_attempt"]) == (0, 1)
    assert _blocked_waits(env.db, [*ids, hostile]) == []
    assert [r for r in _provider_states(env.db, waf.url) if r["blocked_reason"]] == []
    # Promptly: a few seconds (26 s when the 403 blocked the model for the fleet, with the
    # default 15 s probe interval).
    assert took < 30, took


def test_a_job_that_meets_a_confirmed_block_again_ends_in_dead_letter(
        env: Env, fake: str) -> None:
    """A revoked key (the probe is refused too) blocks the model and the job that met it is
    handed back uncounted, marked met; unblocked by hand (`calmq provider unblock PROVIDER
    MODEL`) while the key is still refused, the job meets the refusal again and ends in
    dead_letter (provider_auth), not queued for ever."""
    pool = env.pool("metonce")
    env.procs.worker(pool, **_worker_settings(fake))
    _post(fake + "/admin/outage", {"seconds": 600, "statuses": [401]})
    [job_id] = env.submit(pool, {"text": "a job before the key is fixed"}, priority="bulk")
    wait_for(lambda: _counts(env.db, [job_id])["waiting"] == 1, timeout=60,
             what="the job to wait for the blocked provider")
    [waited] = _blocked_waits(env.db, [job_id])
    assert (waited["detail"]["reason"], waited["detail"]["met"]) == ("provider_blocked", True)
    [blocked] = [r for r in _provider_states(env.db, fake) if r["blocked_reason"]]
    unblocked = calmq(env.stack, "provider", "unblock", blocked["provider"],
                      blocked["model"], "-o", "json")
    assert unblocked.returncode == 0, unblocked.stderr
    assert json.loads(unblocked.stdout) == {
        "unblocked": [f"{blocked['provider']} {blocked['model']}"], "jobs_released": 1}
    job = env.finished(job_id, timeout=90)
    assert job["status"] == "dead_letter"
    assert (job["error"]["code"], job["error"]["class"], job["attempt"]) == (
        "provider_auth", "permission", 1)
    assert len(_blocked_waits(env.db, [job_id])) == 1  # no second hand-back


def test_provider_unpause_lifts_a_long_rate_limit_pause_at_once(env: Env, fake: str) -> None:
    """A 429 asking for an hour pauses the model for the clamp (300 s), fleet-wide; `calmq
    provider unpause PROVIDER MODEL` lifts it and the jobs waiting behind it complete at
    once."""
    pool = env.pool("unpause")
    env.procs.worker(pool, **_worker_settings(fake, step_timeout_seconds="90"))
    _post(fake + "/admin/outage", {"seconds": 600, "statuses": [429],
                                   "retry_after_seconds": 3600})
    [limited] = env.submit(pool, {"text": "limited"}, max_attempts=1, priority="bulk")
    [paused] = wait_for(lambda: [r for r in _provider_states(env.db, fake)
                                 if r["paused_seconds"] > 200], timeout=90,
                        what="the fleet-wide pause of the model")
    assert paused["paused_seconds"] <= 300  # an hour asked, the clamp taken
    assert env.finished(limited)["error"]["code"] == "rate_limited"
    _post(fake + "/admin/outage", {"seconds": 0, "statuses": [429]})  # the provider is back
    ids = env.submit(pool, *({"text": f"behind the pause {n}"} for n in range(3)),
                     priority="bulk")
    out = calmq(env.stack, "provider", "unpause", paused["provider"], paused["model"],
                "-o", "json", env=calmq_env(env.stack))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["unpaused"] == [f"{paused['provider']} {paused['model']}"]
    wait_for(lambda: _counts(env.db, ids)["completed"] == 3, timeout=90,
             what="the jobs behind the pause to complete")
    assert [r["paused_seconds"] for r in _provider_states(env.db, fake)] == [0]
