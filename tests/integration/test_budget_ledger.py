"""The budget buckets in the real PostgreSQL: leases, the interactive share, give-back, pause."""

from __future__ import annotations

import asyncio
import uuid

from calmq.calls.budget import BucketLimits, TokenBudget
from calmq.data import Database
from calmq.data.budget import BudgetLedger

# 600 requests a minute: a 10-request bucket, 2 of them held for interactive.
LIMITS = BucketLimits(tokens_per_minute=0, requests_per_minute=600, interactive_share=0.2,
                      burst_seconds=1.0, lease_seconds=0.5)


async def _bucket(db: Database, limits: BucketLimits = LIMITS) -> str:
    """A fresh bucket row whose buckets are full (as after a second of no traffic)."""
    model = f"m-{uuid.uuid4().hex[:8]}"
    await BudgetLedger(db).configure("test", model, limits)
    async with db.pool.connection() as conn:
        await conn.execute("UPDATE budget_buckets SET refilled_at = clock_timestamp()"
                           " - interval '1 minute' WHERE provider = 'test' AND model = %s",
                           (model,))
    return model


async def test_bulk_gets_only_its_share_and_interactive_the_rest(
    db: Database,
) -> None:
    """From full buckets bulk leases 8 of 10 requests; interactive can still lease the 2."""
    ledger = BudgetLedger(db)
    model = await _bucket(db)
    bulk = await ledger.take("test", model, "bulk", need_tokens=1, want_tokens=1,
                             want_requests=100)
    assert bulk.requests == 8
    again = await ledger.take("test", model, "bulk", need_tokens=1, want_tokens=1,
                              want_requests=100)
    assert again.requests == 0
    assert again.wait_seconds > 0
    interactive = await ledger.take("test", model, "interactive", need_tokens=1,
                                    want_tokens=1, want_requests=100)
    assert interactive.requests == 2


async def test_given_back_budget_can_be_leased_again_but_not_beyond_capacity(
    db: Database,
) -> None:
    """Unspent requests go back to the bucket; giving back more never exceeds its capacity."""
    ledger = BudgetLedger(db)
    model = await _bucket(db)
    await ledger.take("test", model, "bulk", need_tokens=1, want_tokens=1, want_requests=100)
    await ledger.give_back("test", model, "bulk", 0, 3)
    assert (await ledger.take("test", model, "bulk", need_tokens=1, want_tokens=1,
                              want_requests=100)).requests == 3
    await ledger.give_back("test", model, "bulk", 0, 1000)
    row = await ledger.bucket("test", model)
    assert row is not None
    assert row.bulk_requests <= LIMITS.request_cap * 0.8 + 1e-9


async def test_pause_stops_every_lease_until_it_ends(db: Database) -> None:
    """After a pause no priority gets anything, and the wait says when the pause ends."""
    ledger = BudgetLedger(db)
    model = await _bucket(db)
    await ledger.pause("test", model, 30)
    for priority in ("bulk", "interactive"):
        grant = await ledger.take("test", model, priority, need_tokens=1, want_tokens=1,
                                  want_requests=1)
        assert grant.requests == 0
        assert 25 < grant.wait_seconds <= 30


async def test_big_call_is_granted_once_the_bucket_is_full_and_leaves_a_debt(
    db: Database,
) -> None:
    """A call larger than the bucket is not starved: it runs from a full bucket, which owes."""
    limits = BucketLimits(tokens_per_minute=6_000, requests_per_minute=0, burst_seconds=1.0)
    ledger = BudgetLedger(db)
    model = await _bucket(db, limits)
    grant = await ledger.take("test", model, "bulk", need_tokens=500, want_tokens=500,
                              want_requests=1)
    assert grant.tokens == 500
    row = await ledger.bucket("test", model)
    assert row is not None
    assert row.bulk_tokens < 0
    follow = await ledger.take("test", model, "bulk", need_tokens=10, want_tokens=10,
                               want_requests=1)
    assert follow.tokens == 0


async def test_three_processes_never_lease_more_than_the_rate_allows(
    db: Database,
) -> None:
    """Three budgets hammering one bucket get no more than a bucket plus its refill."""
    limits = BucketLimits(tokens_per_minute=0, requests_per_minute=1200, interactive_share=0.2,
                          burst_seconds=1.0, lease_seconds=0.5)
    model = f"m-{uuid.uuid4().hex[:8]}"
    budgets = [TokenBudget(BudgetLedger(db), "test", model, limits) for _ in range(3)]
    for budget in budgets:
        await budget.start()
    loop = asyncio.get_running_loop()
    started = loop.time()
    admitted = 0

    async def caller(budget: TokenBudget) -> None:
        nonlocal admitted
        while loop.time() - started < 2.0:
            await budget.acquire(1, "bulk")
            admitted += 1

    try:
        await asyncio.wait_for(asyncio.gather(*(caller(b) for b in budgets for _ in range(5))),
                               10)
    finally:
        for budget in budgets:
            await budget.close()
    elapsed = loop.time() - started
    # The bucket starts empty: at most the refill over the run plus one bucket (slack for
    # the calls admitted just as the 2 s ran out).
    assert admitted <= limits.request_rate * elapsed + limits.request_cap + 15
    assert admitted >= limits.request_rate * 2.0 * 0.5  # and the fleet is not starved
