"""Failures read the way the providers mean them, on the real stack: a revoked key or
exhausted billing pauses the provider fleet-wide with no attempt counted and nothing
dead-lettered; a rate limit's retry-after-ms holds every worker; a context-length error is
the job's input. Each test runs a fake provider of its own (an outage must not reach the
other tests) behind real workers, Kafka and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from calmq.tooling.devstack import StackState, processes
from tests.support.waiting import wait_for
from tests.support.workers import (
    BASE,
    Env,
    Procs,
    create_pool_topics,
    fake_stats,
    job_rows,
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
