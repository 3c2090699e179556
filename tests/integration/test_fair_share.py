"""Fair share inside a queue (setting fair_share, issue 31), on the real stack with two
workers: a tenant's backlog waits in PostgreSQL (``queued``, ``waiting_reason``
``fair_share``) instead of in Kafka ahead of another tenant's jobs, and the slots that free
go to the tenant furthest below its weighted share of the queue's running jobs.

The fleet: two workers of a pool of their own, 4 call slots each (5 jobs claimed each: the
in-flight window), against a fake provider that answers after 1 s: about 8 jobs a second.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from calmq import sql
from calmq.tooling.devstack import StackState, processes
from tests.support.cli import insert_jobs, new_tenant
from tests.support.waiting import wait_for
from tests.support.workers import (
    Procs,
    create_pool_topics,
    create_tenant_id,
    start_fake_provider,
    submit,
)

pytestmark = pytest.mark.integration

CALL_MS = 1000
SLOTS = 4  # per worker; 2 workers


@pytest.fixture(scope="module")
def fleet(stack: StackState, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, str]]:
    """Two workers with fair share on, on a pool of their own; yields (pool, database)."""
    log_dir: Path = tmp_path_factory.mktemp("fair-share")
    procs = Procs(stack.env, log_dir)
    pids: list[int] = []
    try:
        pid, url = start_fake_provider(log_dir, "--latency-ms", str(CALL_MS))
        pids.append(pid)
        pool = f"fair{uuid.uuid4().hex[:6]}"
        create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], pool, ["1s"], partitions=4)
        for _ in range(2):
            procs.worker(pool, provider_url=url, fair_share="true", concurrency=str(SLOTS),
                         retry_tiers="1s")
        yield pool, stack.env["CALMQ_DATABASE_URL"]
    finally:
        procs.stop_all()
        for pid in pids:
            processes.stop(pid)


def _tenant(stack: StackState, weight: float | None = None) -> uuid.UUID:
    name = f"fair-{uuid.uuid4().hex[:8]}"
    tenant, _key = create_tenant_id(stack.env["CALMQ_DATABASE_URL"], name)
    if weight is not None:  # as an operator sets it
        out = subprocess.run(
            [sys.executable, "-m", "calmq.cli", "tenants", "set-weight", name, "--weight",
             str(weight)], env={**stack.env, "PATH": "/usr/bin:/bin"}, capture_output=True,
            text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert f"weight of {name}: {weight:g}" in out.stdout
    return tenant


def _jobs(n: int, tag: str) -> list[dict[str, Any]]:
    return [{"text": f"{tag} job {i:04d} of the fair share test"} for i in range(n)]


def _started(conn: psycopg.Connection[Any], ids: list[str]) -> dict[str, float]:
    """When each of ``ids`` first ran (epoch s), for those that did."""
    rows = conn.execute(
        "SELECT job_id::text, extract(epoch FROM min(at)) FROM job_events"
        " WHERE type = 'running' AND job_id = ANY(%s::uuid[]) GROUP BY job_id",
        (ids,)).fetchall()
    return {r[0]: float(r[1]) for r in rows}


def _statuses(conn: psycopg.Connection[Any], ids: list[str]) -> dict[str, int]:
    rows = conn.execute("SELECT status, count(*) FROM jobs WHERE id = ANY(%s::uuid[])"
                        " GROUP BY status", (ids,)).fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


@pytest.mark.timeout(240)
def test_a_small_tenant_is_not_stuck_behind_another_tenants_backlog(
        stack: StackState, fleet: tuple[str, str]) -> None:
    """A big tenant's 80 jobs (10 s of the fleet's slots) are running and waiting; a small
    tenant's 4 then start within two calls' time, long before the backlog is through,
    while the backlog waits visibly in the waiting room (and completes, none lost). In
    Kafka's order they waited behind ~70 jobs: ~9 s."""
    pool, db = fleet
    big, small = _tenant(stack), _tenant(stack)
    backlog = submit(db, big, pool, _jobs(80, "backlog"), priority="bulk")
    with psycopg.connect(db, autocommit=True) as conn:
        # The backlog fills the slots and the rest waits in PostgreSQL, visibly.
        wait_for(lambda: _statuses(conn, backlog).get("running", 0) >= 2 * SLOTS, timeout=60,
                 what="the backlog to fill the fleet's slots")
        waiting = wait_for(lambda: conn.execute(
            "SELECT id::text FROM jobs WHERE id = ANY(%s::uuid[]) AND status = 'queued'"
            " AND waiting_reason = 'fair_share' LIMIT 1", (backlog,)).fetchone(),
            timeout=30, what="a backlog job waiting in the waiting room")
        few = submit(db, small, pool, _jobs(4, "small"), priority="bulk")
        created = {r[0]: float(r[1]) for r in conn.execute(
            "SELECT id::text, extract(epoch FROM created_at) FROM jobs"
            " WHERE id = ANY(%s::uuid[])", (few,)).fetchall()}
        running: list[int] = []

        def all_started() -> dict[str, float] | None:
            running.append(_statuses(conn, backlog + few).get("running", 0))
            s = _started(conn, few)
            return s if len(s) == len(few) else None

        started = wait_for(all_started, timeout=60, what="the small tenant's jobs to start")
        # Never more running than the fleet's in-flight window (2 workers x 5), picked or not.
        assert max(running) <= 2 * (SLOTS + 1), running
        waits = {i: started[i] - created[i] for i in few}
        # Two calls at most: the slots free one every 1/8 s; the rest is the hold and pick.
        assert max(waits.values()) <= 2 * CALL_MS / 1000, waits
        # ... and the backlog was far from through when the last of them started.
        last = max(started.values())
        behind = len(backlog) - sum(1 for t in _started(conn, backlog).values() if t <= last)
        assert behind >= 30, behind
        # The waiting job's history says why it waited, and no attempt was counted for it.
        events = conn.execute(
            "SELECT type, detail FROM job_events WHERE job_id = %s ORDER BY id",
            (waiting[0],)).fetchall()
        held = [d for t, d in events if t == "waiting"]
        assert held == [{"reason": "fair_share", "pool": pool, "priority": "bulk"}], events
        wait_for(lambda: _statuses(conn, backlog + few) == {"completed": len(backlog) + 4},
                 timeout=120, what="every job of both tenants to complete")
        attempts = conn.execute(
            "SELECT max(attempt) FROM jobs WHERE id = ANY(%s::uuid[])",
            (backlog + few,)).fetchone()
        assert attempts == (1,)  # waiting counted no attempt


@pytest.mark.timeout(240)
def test_busy_tenants_share_the_slots_by_weight(stack: StackState,
                                                fleet: tuple[str, str]) -> None:
    """Tenant A (weight 1) submits 60 jobs, then tenant B (weight 3) 60. In Kafka's order
    all of A's would start before B's first; with equal weights A would still take half the
    slots, so all its 60 before B's last. At weights 1 and 3 A gets a quarter of the slots
    while both wait: when B's last job starts, A has started its first slots' worth plus
    about a third of B's 60, far fewer than 60."""
    pool, db = fleet
    a, b = _tenant(stack, 1), _tenant(stack, 3)
    first = submit(db, a, pool, _jobs(60, "weight-1"), priority="bulk")
    second = submit(db, b, pool, _jobs(60, "weight-3"), priority="bulk")
    with psycopg.connect(db, autocommit=True) as conn:
        started_b = wait_for(
            lambda: (s := _started(conn, second)) and len(s) == len(second) and s,
            timeout=120, what="the weight-3 tenant's jobs to start")
        last_b = max(started_b.values())
        a_by_then = sum(1 for t in _started(conn, first).values() if t <= last_b)
        # Ideal: the fleet's 10 claimed slots, then 60 / 3 = 20: 30. Equal weights: 60.
        assert 12 <= a_by_then <= 42, a_by_then
        wait_for(lambda: _statuses(conn, first + second) == {"completed": 120}, timeout=120,
                 what="both tenants' jobs to complete")



def _pick(stack: StackState, running: dict[uuid.UUID, int], waiting: dict[uuid.UUID, int],
          limit: int, headroom: int
          ) -> tuple[list[uuid.UUID], bool, dict[uuid.UUID, list[uuid.UUID]]]:
    """One fair_share_pick on a queue no worker serves, with ``running`` and ``waiting`` jobs
    per tenant (waiting ones created in the dict's order, each tenant's oldest first):
    (the ids it took in its order, whether it said more wait, the waiting ids per tenant)."""
    pool = f"pick{uuid.uuid4().hex[:6]}"  # no worker serves it: nothing else picks here
    runs = [i for t, n in running.items() for i in insert_jobs(stack, t, n, status="queued")]
    waits = {t: insert_jobs(stack, t, n, status="queued") for t, n in waiting.items()}
    everything = runs + [i for ids in waits.values() for i in ids]
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"], autocommit=True) as conn:
        try:
            conn.execute("UPDATE jobs SET pool = %s WHERE id = ANY(%s)", (pool, everything))
            conn.execute("UPDATE jobs SET status = 'running' WHERE id = ANY(%s)", (runs,))
            conn.execute("UPDATE jobs SET waiting_reason = 'fair_share' WHERE id = ANY(%s)"
                         " AND status = 'queued'", (everything,))
            rows = conn.execute(sql.queries()["fair_share_pick"], {
                "pool": pool, "priority": "bulk", "limit": limit, "headroom": headroom,
            }).fetchall()
        finally:
            conn.execute("UPDATE jobs SET status = 'cancelled', waiting_reason = NULL"
                         " WHERE id = ANY(%s)", (everything,))
    return [r[0] for r in rows if r[0] is not None], any(r[0] is None for r in rows), waits


def test_the_pick_returns_the_fairest_first(stack: StackState) -> None:
    """The worker starts a pick's attempts in the order the pick returns them, and a wave of
    a few hundred takes a while to start on one event loop: the pick must return them
    fairest first. Here tenant A's newer job (A runs nothing) comes before tenant B's older
    ones (B runs two), which come oldest first; by id or by row order B's would come first
    (the small tenant's p99 in ``calmq bench fairness``)."""
    a, b = new_tenant(stack, "pick-a")[1], new_tenant(stack, "pick-b")[1]
    taken, more, waits = _pick(stack, {b: 2}, {b: 3, a: 1}, limit=3, headroom=0)
    # A: (0 running + 1) / 1 = 1; B's: 3, 4, 5, so B's third stays in the room.
    assert taken == waits[a] + waits[b][:2]
    assert more


def test_the_headroom_is_left_to_a_tenant_within_its_share(stack: StackState) -> None:
    """While tenant A runs, tenant B (above its share) leaves the pick's last ``headroom``
    slots free for A's next job; alone, B takes every slot (the pick is work-conserving)."""
    a, b = new_tenant(stack, "room-a")[1], new_tenant(stack, "room-b")[1]
    # Level: (3 running + 3 slots) / 2 tenants = 3. B's next three would bring it to 3, 4,
    # 5: only the first fits, and the headroom keeps the last two slots from B's others.
    taken, more, waits = _pick(stack, {a: 1, b: 2}, {b: 3}, limit=3, headroom=2)
    assert taken == waits[b][:1]
    assert more  # the queue stays contended: B's others still wait
    # B alone: level (2 + 3) / 1 = 5, so all three fit.
    taken, more, waits = _pick(stack, {b: 2}, {b: 3}, limit=3, headroom=2)
    assert taken == waits[b]
    assert not more
    # A job of A arriving meanwhile takes a headroom slot, ahead of B's: its share is 2.
    taken, more, waits = _pick(stack, {a: 1, b: 2}, {b: 3, a: 1}, limit=2, headroom=2)
    assert taken == waits[a]
    assert more
