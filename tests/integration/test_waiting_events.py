"""`waiting` events (issue 42): a hold writes one when a job starts to wait for a reason at
its step and attempt, not again each time a release pass lets it go and the same hold takes
it back without the job having run."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from calmq.data import Database
from calmq.data.fairness import FairQueue
from calmq.data.spending import SpendLedger
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.integration


def _queued_job(url: str, pool: str) -> uuid.UUID:
    """A queued job of a new tenant, in a lane of its own."""
    job, tenant = uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)", (tenant, f"t-{tenant.hex}"))
        conn.execute(
            "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool,"
            " step, attempt, max_attempts, input, metadata)"
            " VALUES (%s, %s, 'summarize', 1, 'queued', 'bulk', %s, 'summarize', 0, 3,"
            " '{\"text\": \"x\"}', '{}')", (job, tenant, pool))
    return job


def _waiting_events(url: str, job: uuid.UUID) -> list[Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [r[0] for r in conn.execute(
            "SELECT detail->>'reason' FROM job_events WHERE job_id = %s AND type = 'waiting'"
            " ORDER BY id", (job,)).fetchall()]


def _reason(url: str, job: uuid.UUID) -> str | None:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT waiting_reason FROM jobs WHERE id = %s", (job,)).fetchone()
    assert row is not None
    reason: str | None = row[0]
    return reason


async def test_a_fair_share_hold_after_a_pick_writes_no_second_event(db: Database) -> None:
    """A job held in the waiting room, picked out of it and held again (its claim did not
    happen) has one waiting event; a hold for another reason then writes its own."""
    url = db.url
    pool = f"wait{uuid.uuid4().hex[:8]}"
    job = _queued_job(url, pool)
    room = FairQueue(db)
    for _ in range(3):
        assert await room.hold([job]) == {job}
        picked = await room.pick(pool, "bulk", limit=10)
        assert [p.id for p in picked.jobs] == [job]
    assert _waiting_events(url, job) == ["fair_share"]
    assert await SpendLedger(db).hold([job], "spend_cap_daily", {}) == [job]
    assert _waiting_events(url, job) == ["fair_share", "spend_cap_daily"]


async def test_a_job_picked_and_never_claimed_goes_back_into_its_room_after_the_grace(
        db: Database) -> None:
    """A worker killed between its pick and its claim: no message carries the job it picked,
    so the reaper's pass puts it back into the room once the grace (a lease) is over, and
    the lane's next pick takes it; a pass within the grace leaves it to its claim."""
    url = db.url
    pool = f"pick{uuid.uuid4().hex[:8]}"
    job = _queued_job(url, pool)
    room = FairQueue(db)
    assert not await room.waiting(pool, "bulk")
    assert await room.hold([job]) == {job}
    assert await room.waiting(pool, "bulk")  # what a worker holding none of them looks for
    assert not await room.waiting(pool, "interactive")
    assert [p.id for p in (await room.pick(pool, "bulk", limit=10)).jobs] == [job]
    assert _reason(url, job) == "fair_share_picked"  # out of the room, on its way to a claim
    assert not await room.waiting(pool, "bulk")
    assert (await room.pick(pool, "bulk", limit=10)).jobs == []
    await room.return_picked(grace_seconds=3600)
    assert _reason(url, job) == "fair_share_picked"
    with psycopg.connect(url, autocommit=True) as conn:  # the lease is over
        conn.execute("UPDATE jobs SET updated_at = now() - interval '1 minute' WHERE id = %s",
                     (job,))
    await room.return_picked(grace_seconds=30)
    assert _reason(url, job) == "fair_share"
    assert await room.waiting(pool, "bulk")
    assert [p.id for p in (await room.pick(pool, "bulk", limit=10)).jobs] == [job]
    assert _waiting_events(url, job) == ["fair_share"]


async def test_a_spend_cap_hold_after_a_release_writes_no_second_event(db: Database) -> None:
    """A job held for a spend cap, released by the release pass (the cap no longer holding)
    and held again by the next worker that meets the cap, has one waiting event."""
    url = db.url
    job = _queued_job(url, f"wait{uuid.uuid4().hex[:8]}")
    spending = SpendLedger(db)
    for _ in range(3):
        assert await spending.hold([job], "spend_cap_daily", {"cap_usd": 1.0}) == [job]

        async def released() -> bool:
            # One pass at a time in the fleet: the stack's own services may run it instead.
            await spending.release(held_bulk=[], held_all=[], fleet_bulk=False,
                                   fleet_all=False, limit=10_000)
            return _reason(url, job) is None

        await wait_for_async(released, within=30.0, what="the release pass let the job go")
    assert _waiting_events(url, job) == ["spend_cap_daily"]
