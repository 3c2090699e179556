"""kill -9 of a worker, twice, in the middle of a 2,000-job run: every job completes, and no
job's result is written twice.

Two worker processes share a test pool; a fake provider of the test's own counts the calls
per job. A call can be answered twice only for a job whose first worker died mid-call (the
provider answered a process that was gone): such a job's history must say
``requeued_after_restart``, and its result is still recorded exactly once.
"""

from __future__ import annotations

import os
import signal
import socket
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator

import psycopg
import pytest

from calmq.tooling.devstack import StackState, processes
from tests.support.waiting import wait_for
from tests.support.workers import BASE, TIERS, Env, Procs, create_pool_topics, fake_stats

pytestmark = pytest.mark.chaos

JOBS = 2000


@pytest.fixture(scope="module")
def env(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    procs = Procs(stack.env, tmp_path_factory.mktemp("chaos-logs"))
    try:
        yield Env(stack, procs)
    finally:
        procs.stop_all()


def _fake_provider(procs: Procs) -> str:
    port = processes.free_port()
    procs.start("fake-provider", "fake-provider", "--port", str(port), "--latency-ms", "20")
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    wait_for(healthy, timeout=30, what="the test's fake provider")
    return url


def test_two_kills_lose_no_job_and_write_no_result_twice(env: Env) -> None:
    """2,000 jobs, two workers, one killed with -9 twice: all complete, each result once."""
    pool = f"t4chaos{uuid.uuid4().hex[:6]}"
    create_pool_topics(env.bootstrap, pool, TIERS.split(","), partitions=4)
    fake = _fake_provider(env.procs)
    settings = {**BASE, "fake_provider_url": fake, "concurrency": "32"}
    # Every job is queued before the workers start, and each call takes 300 ms, so a worker
    # has calls in flight when it is killed (not idle, waiting for submissions).
    # Half on each priority: the group balances partition counts, not topics, so a worker may
    # own only interactive (or only bulk) partitions; this way each of them has work.
    ids = [job for priority in ("interactive", "bulk") for job in env.submit(
        pool, *[{"text": f"chaos {priority} {i}", "mode": "success", "delay_ms": 300}
                for i in range(JOBS // 2)], priority=priority)]
    victim, _ = env.procs.worker(pool, **settings)
    env.procs.worker(pool, **settings)

    def completed() -> int:
        with psycopg.connect(env.db) as conn:
            row = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s::uuid[]) "
                               "AND status = 'completed'", (ids,)).fetchone()
        return int(row[0]) if row else 0

    def running_on(pid: int) -> int:
        with psycopg.connect(env.db) as conn:
            row = conn.execute("SELECT count(*) FROM jobs WHERE status = 'running' "
                               "AND lease_owner = %s", (f"{socket.gethostname()}-{pid}",)
                               ).fetchone()
        return int(row[0]) if row else 0

    for kill, threshold in enumerate((JOBS // 5, JOBS // 2), start=1):
        wait_for(lambda t=threshold: completed() >= t, timeout=120,
                 what=f"{threshold} jobs completed before kill {kill}")
        # Kill while it holds leases: a worker between two batches has nothing to lose.
        wait_for(lambda p=victim.pid: running_on(p), timeout=60,
                 what=f"the victim to be running jobs before kill {kill}")
        assert completed() < JOBS, "the run ended before the kill: nothing was tested"
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        victim, _ = env.procs.worker(pool, **settings)
    wait_for(lambda: completed() == JOBS, timeout=240, what="every job to complete")

    with psycopg.connect(env.db) as conn:
        events = conn.execute(
            "SELECT job_id::text, type FROM job_events WHERE job_id = ANY(%s::uuid[])",
            (ids,)).fetchall()
        by_worker = conn.execute(
            "SELECT detail->>'worker', count(*), min(at), max(at) FROM job_events "
            "WHERE job_id = ANY(%s::uuid[]) AND type = 'running' GROUP BY 1",
            (ids,)).fetchall()
    completed_events = Counter(job for job, kind in events if kind == "completed")
    requeued = {job for job, kind in events if kind == "requeued_after_restart"}
    assert set(completed_events) == set(ids)
    assert max(completed_events.values()) == 1  # each result recorded once

    by_job = fake_stats(fake)["by_job"]
    answered = {job: by_job[job]["completed"] for job in ids}
    assert min(answered.values()) >= 1
    answered_twice = {job for job, n in answered.items() if n > 1}
    # A second answer only where a worker died mid-call, never from a duplicate delivery.
    assert answered_twice <= requeued
    assert requeued, f"no job was in flight at a kill (runs by worker: {by_worker})"
