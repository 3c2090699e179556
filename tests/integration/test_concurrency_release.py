"""The release passes of held jobs against the real PostgreSQL (issue 42): the concurrency
keys' pass locks at most a batch of keys (read from pg_locks while its transaction is
open) and moves on across passes to every key; a tenant's jobs wait for at most
``concurrency_keys_waiting_max`` distinct keys, the rest behind them; the spend caps'
stale pass releases only the waits it owns.

Driven pass by pass (the data layer's own code on a real Store), on workflows no process of
the stack knows, so that no worker's pass releases the test's jobs."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest

from calmq.data import Store
from calmq.data.concurrency import ConcurrencyKeys, ReleasePass
from calmq.data.spending import SpendLedger
from calmq.settings import Settings
from calmq.tooling.devstack import StackState
from tests.support.cli import insert_jobs, new_tenant
from tests.support.waiting import wait_for_async
from tests.support.workers import create_pool_topics

pytestmark = pytest.mark.integration

KEYS = 20_000
BATCH: int = Settings.model_fields["concurrency_release_batch"].default


def _insert_waiting(url: str, tenant: uuid.UUID, workflow: str, keys: int) -> None:
    """Per key ``customer-000001``..: one job in flight (admitted, not claimed yet) and one
    waiting for it, on a pool nobody consumes. The keys are at their limit of 1: a pass
    locks them and releases nothing (no outbox rows to write), so the passes stay cheap."""
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,"
            " pool, step, attempt, max_attempts, input, concurrency_key, waiting_reason,"
            " key_admitted_at, created_at, updated_at)"
            " SELECT gen_random_uuid(), %s, %s, 1, 'queued', 'bulk', 'keys-nobody',"
            " 'summarize', 0, 3, '{}'::jsonb, 'customer-' || lpad(i::text, 6, '0'),"
            " CASE WHEN w THEN 'concurrency_key' END, CASE WHEN NOT w THEN now() END,"
            " now() - interval '1 minute', now() - interval '1 minute'"
            " FROM generate_series(1, %s) i, (VALUES (true), (false)) AS v(w)",
            (tenant, workflow, keys))


def _cancel(url: str, tenant: uuid.UUID) -> None:
    with psycopg.connect(url) as conn:
        conn.execute("UPDATE jobs SET status = 'cancelled', waiting_reason = NULL,"
                     " key_admitted_at = NULL WHERE tenant_id = %s", (tenant,))


async def _bounded_passes(url: str, workflow: str) -> tuple[int, int, set[str]]:
    """Release passes, each in a transaction the test holds open while it reads the pass's
    advisory locks from another connection, then rolls back; until every key was locked by
    one. Returns (passes, the most advisory locks one pass held, the keys locked)."""
    store = Store(url, min_size=1, max_size=1)
    await store.open()
    keys = ConcurrencyKeys(store, batch=BATCH)
    locked: set[str] = set()
    passes = most = 0
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as watch:
            async def one_pass() -> ReleasePass | None:
                nonlocal most
                async with store.pool.connection() as conn:
                    pid = conn.info.backend_pid
                    async with conn.transaction(force_rollback=True):
                        done = await keys.release_on(conn, {workflow: 1}, [workflow],
                                                     3600.0, waiting_max=KEYS)
                        cur = await watch.execute(
                            "SELECT count(*) FROM pg_locks"
                            " WHERE locktype = 'advisory' AND pid = %s", (pid,))
                        row = await cur.fetchone()
                        assert row is not None
                        most = max(most, row[0])
                return done if done.ran else None  # another process's pass had the turn

            while len(locked) < KEYS and passes < KEYS // BATCH + 3:
                done = await wait_for_async(one_pass, within=30, what="the fleet's turn")
                passes += 1
                assert len(done.keys) <= BATCH
                assert done.jobs == []  # each key is at its limit
                locked.update(key for _tenant, key in done.keys)
    finally:
        await store.close()
    return passes, most, locked


@pytest.mark.timeout(300)
def test_a_release_pass_locks_at_most_its_batch_of_20000_waiting_keys_and_moves_on(
        stack: StackState) -> None:
    """With 20,000 keys waiting, no release pass holds more advisory locks than its batch
    (and the fleet's turn), and successive passes reach every key."""
    url = stack.env["CALMQ_DATABASE_URL"]
    _name, tenant, _key = new_tenant(stack, "keybatch")
    workflow = f"bounded_{uuid.uuid4().hex[:6]}"
    _insert_waiting(url, tenant, workflow, KEYS)
    try:
        passes, most, locked = asyncio.run(_bounded_passes(url, workflow))
    finally:
        _cancel(url, tenant)
    assert most <= BATCH + 1, most  # the keys' locks and the fleet's pass lock
    assert most >= BATCH  # the pass did lock a whole batch (the read saw it)
    assert len(locked) == KEYS
    assert passes <= KEYS // BATCH + 2, passes


async def _cap_scenario(url: str, tenant: uuid.UUID, workflow: str,
                        blockers: dict[str, uuid.UUID], waiting: dict[str, uuid.UUID]
                        ) -> tuple[dict[uuid.UUID, str], ReleasePass]:
    store = Store(url, min_size=1, max_size=2)
    await store.open()
    try:
        keys = ConcurrencyKeys(store)
        held = await keys.admit(list(waiting.values()), {workflow: 1}, 60.0, waiting_max=3)
        # The first key's job in flight ends: its waiting job may run, and the job that
        # waited longest behind the tenant's keys takes the place its key leaves.
        async with store.pool.connection() as conn:
            await conn.execute("UPDATE jobs SET status = 'completed', key_admitted_at = NULL"
                               " WHERE id = %s", (blockers["customer-1"],))

        async def one_pass() -> ReleasePass | None:
            done = await keys.release({workflow: 1}, [workflow], 60.0, waiting_max=3)
            return done if done.ran else None

        done = await wait_for_async(one_pass, within=30, what="the fleet's turn")
    finally:
        await store.close()
    return held, done


def test_a_tenants_jobs_wait_for_at_most_its_cap_of_keys_and_the_rest_behind_them(
        stack: StackState) -> None:
    """With a cap of 3 waiting keys, of five busy keys' next jobs three wait for their keys
    and two behind the tenant's keys (a ``waiting`` event says so); as a key stops waiting
    the oldest of the two takes its place, and none runs past its key's limit."""
    url = stack.env["CALMQ_DATABASE_URL"]
    _name, tenant, _key = new_tenant(stack, "keycap")
    workflow = f"capped_{uuid.uuid4().hex[:6]}"
    names = [f"customer-{i}" for i in range(1, 6)]
    # A pool no worker consumes: the job the pass releases is published to its topic, and a
    # worker reading it would claim it (or hold it for fair share) before the test reads it.
    pool = f"keycap{uuid.uuid4().hex[:6]}"
    create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], pool, [], partitions=1)
    ids = insert_jobs(stack, tenant, 10, status="queued", workflow=workflow, pool=pool)
    blockers = dict(zip(names, ids[:5], strict=True))
    waiting = dict(zip(names, ids[5:], strict=True))
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            for name in names:  # one job of each key in flight (admitted, not claimed yet)
                conn.execute("UPDATE jobs SET concurrency_key = %s, key_admitted_at = now()"
                             " WHERE id = %s", (name, blockers[name]))
                conn.execute("UPDATE jobs SET concurrency_key = %s WHERE id = %s",
                             (name, waiting[name]))
            held, done = asyncio.run(_cap_scenario(url, tenant, workflow, blockers, waiting))
            assert held == {waiting[n]: "concurrency_key" for n in names[:3]} | {
                waiting[n]: "concurrency_keys_waiting" for n in names[3:]}
            event = conn.execute(
                "SELECT detail FROM job_events WHERE job_id = %s AND type = 'waiting'",
                (waiting["customer-5"],)).fetchone()
            assert event is not None
            assert event[0] == {"reason": "concurrency_keys_waiting", "key": "customer-5",
                                "max_waiting_keys": 3}
            assert [j.id for j in done.jobs] == [waiting["customer-1"]]
            assert done.promoted == 1
            reasons = dict(conn.execute(
                "SELECT concurrency_key, waiting_reason FROM jobs WHERE id = ANY(%s)",
                (list(waiting.values()),)).fetchall())
            assert reasons == {"customer-1": None, "customer-2": "concurrency_key",
                               "customer-3": "concurrency_key",
                               "customer-4": "concurrency_key",
                               "customer-5": "concurrency_keys_waiting"}
    finally:
        _cancel(url, tenant)


async def _spend_passes(url: str, others: list[uuid.UUID]) -> set[uuid.UUID]:
    """Stale spend release passes (grace 60 s) until ``others`` were released (by these
    passes or the stack's worker's); returns the jobs these passes released (what a pass
    logs as spend-cap releases)."""
    store = Store(url, min_size=1, max_size=1)
    await store.open()
    released: set[uuid.UUID] = set()
    try:
        ledger = SpendLedger(store)

        async def one_pass() -> bool:
            jobs = await ledger.release(held_bulk=[], held_all=[], fleet_bulk=False,
                                        fleet_all=False, stale_seconds=60.0)
            released.update(j.id for j in jobs)
            async with store.pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT count(*) AS n FROM jobs WHERE id = ANY(%s)"
                    " AND waiting_reason IS NOT NULL", (others,))
                row = await cur.fetchone()
            return row is not None and row["n"] == 0

        await wait_for_async(one_pass, within=60, what="the spend release of the test's jobs")
    finally:
        await store.close()
    return released


def test_the_stale_spend_release_leaves_a_job_held_for_its_concurrency_key(
        stack: StackState) -> None:
    """A job held for its concurrency key for longer than the stale grace stays held after
    the spend caps' release pass, which releases the spend cap's and the token quota's
    waits only."""
    url = stack.env["CALMQ_DATABASE_URL"]
    _name, tenant, _key = new_tenant(stack, "spendstale")
    keyed, quota, capped = insert_jobs(stack, tenant, 3, status="queued",
                                       workflow=f"stale_{uuid.uuid4().hex[:6]}")
    reasons: list[tuple[str, Any]] = [("concurrency_key", keyed), ("token_quota", quota),
                                      ("spend_cap_daily", capped)]
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            for reason, job in reasons:  # waiting for five minutes (insert_jobs' updated_at)
                conn.execute("UPDATE jobs SET waiting_reason = %s, concurrency_key = 'c-1',"
                             " updated_at = now() - interval '5 minutes' WHERE id = %s",
                             (reason, job))
            released = asyncio.run(_spend_passes(url, [quota, capped]))
            assert keyed not in released
            row = conn.execute("SELECT waiting_reason FROM jobs WHERE id = %s",
                               (keyed,)).fetchone()
            assert row == ("concurrency_key",)
            resumed = conn.execute("SELECT count(*) FROM job_events WHERE job_id = %s"
                                   " AND type = 'resumed'", (keyed,)).fetchone()
            assert resumed == (0,)
    finally:
        _cancel(url, tenant)
