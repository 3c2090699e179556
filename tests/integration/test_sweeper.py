"""The safety net for waiting jobs without a message (the sweeper), on the real stack.

Jobs here are written straight into PostgreSQL without an outbox row (tests/support/cli.py),
as a message lost after an ack or a rejected publish leaves them: only the sweeper can get
them going again. Each test runs its own sweep pass with a short grace; the stack's workers
(default grace: minutes) consume the re-published message.
"""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

from calmq.data import Job, Store
from calmq.tooling.devstack import StackState
from tests.support.cli import insert_jobs, new_tenant, statuses
from tests.support.waiting import wait_for
from tests.support.workers import history

pytestmark = pytest.mark.integration

GRACE = 60.0  # insert_jobs' jobs were last updated five minutes ago
LONGEST_TIER = 3600.0


async def _passes(url: str, n: int) -> list[list[Job]]:
    """``n`` sweep passes at once, each on its own pool (its own session)."""
    stores = [Store(url, min_size=1, max_size=1) for _ in range(n)]
    for store in stores:
        await store.open()
    try:
        return list(await asyncio.gather(
            *(s.jobs.sweep_stranded(GRACE, LONGEST_TIER) for s in stores)))
    finally:
        for store in stores:
            await store.close()


def _sweep(stack: StackState, n: int = 1) -> list[list[Job]]:
    return asyncio.run(_passes(stack.env["CALMQ_DATABASE_URL"], n))


def _swept_ids(passes: list[list[Job]]) -> list[uuid.UUID]:
    return [job.id for one in passes for job in one]


def _retry_scheduled(stack: StackState, job_id: uuid.UUID, *, ago_s: float,
                     delay_s: float) -> None:
    """The retry_scheduled event a failed attempt writes: ``ago_s`` ago, due ``delay_s``
    after that."""
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute(
            "INSERT INTO job_events (job_id, type, attempt, at, detail)"
            " VALUES (%s, 'retry_scheduled', 0, now() - make_interval(secs => %s),"
            " jsonb_build_object('delay_seconds', %s::float8, 'tier', '5s'))",
            (job_id, ago_s, delay_s))


def _types(stack: StackState, job_id: uuid.UUID) -> list[str]:
    return [e["type"] for e in history(stack.env["CALMQ_DATABASE_URL"], str(job_id))]


def test_a_job_without_a_message_completes_after_a_sweep(stack: StackState) -> None:
    """A queued job, and a retrying job past its due time, that no message carries are
    re-published by a sweep pass (requeued_by_sweeper) and complete."""
    _name, tenant_id, _key = new_tenant(stack, "sweepstuck")
    queued = insert_jobs(stack, tenant_id, 1, status="queued")[0]
    retrying = insert_jobs(stack, tenant_id, 1, status="retrying")[0]
    _retry_scheduled(stack, retrying, ago_s=290, delay_s=5)

    swept = _swept_ids(_sweep(stack))
    assert queued in swept
    assert retrying in swept

    wait_for(lambda: set(statuses(stack, [queued, retrying]).values()) == {"completed"},
             timeout=60, what="the swept jobs to complete")
    for job_id in (queued, retrying):
        types = _types(stack, job_id)
        assert types.count("requeued_by_sweeper") == 1, types
        assert types[-2:] == ["running", "completed"], types


def test_a_job_that_is_not_overdue_is_not_swept(stack: StackState) -> None:
    """A job queued moments ago, and a retrying job whose retry is not due yet (plus the
    grace), are left alone: their messages may still be on the way."""
    _name, tenant_id, _key = new_tenant(stack, "sweepfresh")
    fresh, not_due = insert_jobs(stack, tenant_id, 2, status="queued")
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute("UPDATE jobs SET updated_at = now() WHERE id = %s", (fresh,))
        conn.execute("UPDATE jobs SET status = 'retrying' WHERE id = %s", (not_due,))
    _retry_scheduled(stack, not_due, ago_s=300, delay_s=3000)

    swept = _swept_ids(_sweep(stack))
    assert fresh not in swept
    assert not_due not in swept
    assert statuses(stack, [fresh, not_due]) == {fresh: "queued", not_due: "retrying"}
    for job_id in (fresh, not_due):
        assert "requeued_by_sweeper" not in _types(stack, job_id)


def test_concurrent_sweeps_republish_a_job_once(stack: StackState) -> None:
    """Two sweep passes at the same moment (two processes' housekeeping) re-publish a
    stranded job once: one event, one fresh message."""
    _name, tenant_id, _key = new_tenant(stack, "sweeptwice")
    job_id = insert_jobs(stack, tenant_id, 1, status="queued")[0]

    swept = _swept_ids(_sweep(stack, n=2))
    assert swept.count(job_id) == 1
    assert _types(stack, job_id).count("requeued_by_sweeper") == 1
    wait_for(lambda: statuses(stack, [job_id]) == {job_id: "completed"}, timeout=60,
             what="the swept job to complete")


def _killed_at_cap(stack: StackState, tenant_id: uuid.UUID, *, released: bool = False,
                   ) -> uuid.UUID:
    """A job as a worker killed on its last allowed attempt leaves it: running, attempt =
    max_attempts, its lease expired, its attempt started and never finished (``released``:
    the worker handed the attempt back on shutdown instead)."""
    job_id = insert_jobs(stack, tenant_id, 1, status="running")[0]
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute(
            "UPDATE jobs SET attempt = 3, max_attempts = 3, lease_owner = 'killed-worker',"
            " lease_expires_at = now() - interval '1 minute' WHERE id = %s", (job_id,))
        conn.execute(
            "INSERT INTO job_attempts (job_id, step, attempt, worker, started_at, finished_at,"
            " outcome) VALUES (%s, 'summarize', 3, 'killed-worker',"
            " now() - interval '2 minutes', %s, %s)",
            (job_id, "now()" if released else None, "released" if released else None))
    return job_id


async def _claim(url: str, job_id: uuid.UUID) -> list[Job]:
    store = Store(url, min_size=1, max_size=1)
    await store.open()
    try:
        return await store.jobs.claim([job_id], "sweeper-test-worker", 30.0)
    finally:
        await store.close()


def test_a_job_that_kills_its_worker_every_time_ends_dead_lettered(stack: StackState) -> None:
    """A job whose lease expired on the attempt that used up its budget (its worker was
    killed every time, so no outcome was written) is not claimed again: the reaper
    dead-letters it with the code poison, its history and its outbox events say so."""
    url = stack.env["CALMQ_DATABASE_URL"]
    _name, tenant_id, _key = new_tenant(stack, "poison")
    job_id = _killed_at_cap(stack, tenant_id)

    assert asyncio.run(_claim(url, job_id)) == []  # a redelivered message does not run it

    wait_for(lambda: statuses(stack, [job_id]) == {job_id: "dead_letter"}, timeout=60,
             what="the reaper to dead-letter the job")
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT attempt, error FROM jobs WHERE id = %s", (job_id,)).fetchone()
        outbox = conn.execute("SELECT type FROM outbox WHERE aggregateid = %s ORDER BY type",
                              (str(job_id),)).fetchall()
        outcome = conn.execute("SELECT outcome, error_code FROM job_attempts WHERE job_id = %s",
                               (job_id,)).fetchall()
    assert row is not None
    attempt, error = row
    assert attempt == 3
    assert (error["code"], error["class"]) == ("poison", "input")
    assert [t for (t,) in outbox] == ["job.dead_lettered", "job.result"]
    assert outcome == [("abandoned", "poison")]
    types = _types(stack, job_id)
    assert types[-1] == "dead_lettered", types
    assert "running" not in types, types


def test_an_attempt_handed_back_on_shutdown_does_not_count_as_poison(
        stack: StackState) -> None:
    """An attempt its worker released on shutdown (marked released) is not an attempt that
    killed the worker: the job at its cap can still be claimed."""
    _name, tenant_id, _key = new_tenant(stack, "released")
    job_id = _killed_at_cap(stack, tenant_id, released=True)
    claimed = asyncio.run(_claim(stack.env["CALMQ_DATABASE_URL"], job_id))
    assert [(j.id, j.attempt) for j in claimed] == [(job_id, 4)]
