"""Each tenant's token quota, and the reservation a refused call gives back (issue 15).

One tenant's flood must not put the shared bulk bucket into debt for everyone: a call takes
its estimate from its tenant's quota (per minute; the tenant's own or a fair share of the
fleet's) before the shared buckets, and a worker does not claim more of a tenant's jobs
than its quota serves soon (the rest wait in ``queued`` with the reason ``token_quota``),
so the Kafka partitions behind them stay open to other tenants. A call the provider
refused (503, 429, ...) counted nothing: its reservation goes back to both buckets.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from calmq.calls.budget import BucketLimits, TokenBudget
from calmq.calls.budgeted_provider import BudgetedProvider
from calmq.calls.quota import TenantQuota
from calmq.calls.wires import CallScope, enter_scope, open_provider
from calmq.data import Database
from calmq.data.budget import BudgetLedger, TenantTokenLedger
from calmq.errors import StepFailure
from calmq.tooling.devstack import StackState, processes
from tests.support.waiting import wait_for
from tests.support.workers import Procs, create_pool_topics, create_tenant_id, fake_stats, submit

pytestmark = pytest.mark.integration


async def test_a_refused_call_gives_its_reservation_back(stack: StackState, db: Database
                                                         ) -> None:
    """A call the provider answers 503 leaves neither the shared bulk bucket nor the
    tenant's quota in debt: its whole estimate (far above both buckets' capacity) goes
    back. Before, the failed call kept it and both buckets were left ~270 tokens short."""
    # 600 tokens a minute: buckets of ~10 tokens, refilling ~10 a second; one call's
    # estimate (prompt + 256 max tokens) is far larger, so it is granted on a full bucket
    # and leaves it in debt until it settles.
    limits = BucketLimits(tokens_per_minute=600, requests_per_minute=0, interactive_share=0.2)
    model = f"refund-{uuid.uuid4().hex[:8]}"
    ledger = BudgetLedger(db)
    budget = TokenBudget(ledger, "test", model, limits)
    await budget.start()
    async with db.pool.connection() as conn:  # full buckets, as after a quiet minute
        await conn.execute("UPDATE budget_buckets SET refilled_at = clock_timestamp()"
                           " - interval '1 minute' WHERE provider = 'test' AND model = %s",
                           (model,))
    tenant = uuid.uuid4()
    quota = TenantQuota(TenantTokenLedger(db), 600)
    inner = open_provider("openai", stack.env["CALMQ_FAKE_PROVIDER_URL"], "k", "fake-small")
    provider = BudgetedProvider(inner, provider="test", model=model, budget=budget,
                                quota=quota)
    enter_scope(CallScope(str(uuid.uuid4()), str(tenant), "summarize", "bulk"))
    try:
        with pytest.raises(StepFailure) as failed:
            await provider.complete(
                messages=[{"role": "user",
                           "content": json.dumps({"text": "t", "mode": "always_fail"})}],
                job_id=str(uuid.uuid4()), max_tokens=256)
        assert failed.value.code == "upstream_unavailable"
        await budget.close()  # hands back every unspent slice and settlement at once
        row = await ledger.bucket("test", model)
        assert row is not None
        assert row.bulk_tokens > 0, row  # back to (nearly) full, not ~-270
        level = await TenantTokenLedger(db).level(tenant)
        assert level is not None
        assert level > 0, level
    finally:
        await inner.close()


# -- a flood of one tenant against another tenant's few jobs -----------------------------

TOKENS_PER_JOB = 301  # one summarize call of these inputs: ~45 prompt + 256 max tokens
FLEET_JOBS_PER_MINUTE = 240  # 4 calls a second for the whole fleet
TOKENS_PER_MINUTE = FLEET_JOBS_PER_MINUTE * TOKENS_PER_JOB
SHARE = 0.5  # two active tenants' fair share: 2 calls a second each
FLOOD, FEW = 120, 8


@pytest.fixture
def quota_fleet(stack: StackState, tmp_path: Path) -> Iterator[tuple[Procs, str, str]]:
    """A provider that allows the fleet's tokens per minute, and one worker under that
    budget with the default tenant share, on a pool of its own."""
    procs = Procs(stack.env, tmp_path)
    pids: list[int] = []
    try:
        port = processes.free_port()
        url = f"http://127.0.0.1:{port}"
        pids.append(processes.start(
            [sys.executable, "-m", "calmq.cli", "fake-provider", "--port", str(port),
             "--tokens-per-minute", str(TOKENS_PER_MINUTE)], tmp_path / "fake-provider.log"))
        wait_for(lambda: processes.port_open("127.0.0.1", port), timeout=30,
                 what="the rate-limited fake provider")
        pool = f"quota{uuid.uuid4().hex[:6]}"
        create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], pool, ["1s", "2s", "4s"])
        procs.worker(pool, provider_url=url, budget_tokens_per_minute=str(TOKENS_PER_MINUTE),
                     budget_tenant_share=str(SHARE), retry_tiers="1s,2s,4s")
        yield procs, pool, url
    finally:
        procs.stop_all()
        for pid in pids:
            processes.stop(pid)


def _completed_at(conn: psycopg.Connection[Any], ids: list[str]) -> list[float]:
    rows = conn.execute(
        "SELECT extract(epoch FROM e.at) FROM job_events e WHERE e.type = 'completed'"
        " AND e.job_id = ANY(%s::uuid[])", (ids,)).fetchall()
    return [float(r[0]) for r in rows]


@dataclass
class Flood:
    """Tenant A's flood, then tenant B's few bulk jobs, as each flood test runs them."""

    flooder: uuid.UUID
    flood: list[str]
    few: list[str]
    started: float  # when B submitted
    finished: float  # when B's last job completed


def _flood_then_few(database_url: str, pool: str, priority: str) -> Flood:
    """A submits FLOOD jobs of ``priority``; once one of them completed, B submits FEW bulk
    jobs; returns once B's are all completed (within 90 s)."""
    flooder, _ = create_tenant_id(database_url, f"flood-{uuid.uuid4().hex[:8]}")
    other, _ = create_tenant_id(database_url, f"few-{uuid.uuid4().hex[:8]}")
    flood = submit(database_url, flooder, pool,
                   [{"text": f"{priority} flood job {i:04d} of the quota"}
                    for i in range(FLOOD)], priority=priority)
    with psycopg.connect(database_url, autocommit=True) as conn:
        wait_for(lambda: _completed_at(conn, flood), timeout=60,
                 what="the flood's first completed job")
        started = time.time()
        few = submit(database_url, other, pool,
                     [{"text": f"other tenant job {i:04d} of the test"} for i in range(FEW)],
                     priority="bulk")
        wait_for(lambda: len(_completed_at(conn, few)) == FEW, timeout=90,
                 what="the other tenant's jobs")
        return Flood(flooder, flood, few, started, max(_completed_at(conn, few)))


def _calls_since(conn: psycopg.Connection[Any], tenant: uuid.UUID, since: float
                 ) -> tuple[int, float]:
    """The tenant's model calls started after ``since`` (epoch s), and the seconds since."""
    row = conn.execute(
        "SELECT count(*), extract(epoch FROM clock_timestamp()) - %s"
        " FROM job_attempts a JOIN jobs j ON j.id = a.job_id WHERE j.tenant_id = %s"
        " AND a.model_calls > 0 AND a.started_at > to_timestamp(%s)",
        (since, tenant, since)).fetchone()
    assert row is not None
    return int(row[0]), float(row[1])


def _waited_for_quota(conn: psycopg.Connection[Any], ids: list[str]) -> int:
    """How many of ``ids`` waited unclaimed at their tenant's quota."""
    row = conn.execute(
        "SELECT count(DISTINCT job_id) FROM job_events WHERE type = 'waiting'"
        " AND detail ->> 'reason' = 'token_quota' AND job_id = ANY(%s::uuid[])",
        (ids,)).fetchone()
    assert row is not None
    return int(row[0])


def _wait_resumed(conn: psycopg.Connection[Any], ids: list[str]) -> None:
    """Wait (30 s at most) until one of ``ids`` that waited was re-published."""
    wait_for(lambda: conn.execute(
        "SELECT count(*) FROM job_events WHERE type = 'resumed'"
        " AND job_id = ANY(%s::uuid[])", (ids,)).fetchone()[0] > 0,  # type: ignore[index]
        timeout=30, what="a waiting flood job to resume")


# A's fair share with two tenants active: half the fleet's 4 calls a second.
PER_SECOND = TOKENS_PER_MINUTE * SHARE / 60 / TOKENS_PER_JOB


@pytest.mark.timeout(240)
def test_one_tenants_flood_waits_at_its_quota_and_another_tenant_still_gets_budget(
        stack: StackState, quota_fleet: tuple[Procs, str, str]) -> None:
    """Tenant A submits 120 jobs (half a minute of the fleet's quota), then tenant B 8:
    B's jobs finish within 20 s, while A's calls stay at its fair share (half the fleet's
    with two tenants active: 2 a second) and A's jobs past what its quota serves soon wait
    visibly (``token_quota``) and resume. Without quotas B's jobs waited behind A's whole
    flood (31.8 s measured)."""
    _procs, pool, provider_url = quota_fleet
    database_url = stack.env["CALMQ_DATABASE_URL"]
    run = _flood_then_few(database_url, pool, "bulk")
    assert run.finished - run.started <= 20, run.finished - run.started
    with psycopg.connect(database_url, autocommit=True) as conn:
        # Alone, A had the whole fleet's quota; with B active (B counts for a minute after
        # its last call) A's fair share is half of it. A's calls from a moment after B
        # came (workers read the active tenants every 2 s): at most that rate, plus a bucket.
        since = run.started + 3
        wait_for(lambda: _calls_since(conn, run.flooder, since)[0] >= 20, timeout=60,
                 what="20 more flood calls")
        calls, span = _calls_since(conn, run.flooder, since)
        assert calls <= PER_SECOND * span * 1.1 + 3, (calls, span)
        # Some of A's jobs waited unclaimed with a visible reason, and resumed.
        assert _waited_for_quota(conn, run.flood) > 0
        # B's jobs never waited for a quota (with fair share, on by default, they may wait
        # a moment in the lane's waiting room for a free slot: reason fair_share).
        assert conn.execute(
            "SELECT count(*) FROM job_events WHERE type = 'waiting'"
            " AND detail->>'reason' <> 'fair_share'"
            " AND job_id = ANY(%s::uuid[])", (run.few,)).fetchone() == (0,)
        _wait_resumed(conn, run.flood)
    stats = fake_stats(provider_url)
    assert stats["status_counts"].get("429", 0) <= 0.01 * stats["calls"], stats


DEBT_SECONDS = 10  # CALMQ_BUDGET_INTERACTIVE_DEBT_SECONDS, the default


@pytest.mark.timeout(240)
def test_an_interactive_flood_waits_at_its_quota_and_another_tenants_bulk_gets_its_share(
        stack: StackState, quota_fleet: tuple[Procs, str, str]) -> None:
    """Tenant A submits 120 interactive jobs (half a minute of the fleet's quota), then
    tenant B 8 bulk ones: B's finish within 20 s, since A's interactive calls wait at A's
    quota once past their debt bound (10 s of it) and the worker holds no more of A's
    interactive jobs than that quota serves soon (the rest wait, ``token_quota``). Before,
    interactive calls never waited at a tenant's quota, and the shared buckets serve
    interactive first: B's bulk waited behind A's whole flood (31.9 s measured)."""
    _procs, pool, provider_url = quota_fleet
    database_url = stack.env["CALMQ_DATABASE_URL"]
    run = _flood_then_few(database_url, pool, "interactive")
    with psycopg.connect(database_url, autocommit=True) as conn:
        flood_done = len(_completed_at(conn, run.flood))
        print(f"\nfigures: B's {FEW} bulk jobs done {run.finished - run.started:.1f} s after"
              f" submit; A's interactive jobs done by then: {flood_done} of {FLOOD}")
        assert run.finished - run.started <= 20, (run.finished - run.started, flood_done)
        # Past its debt, A's calls run at its fair share: from the moment B came, at most
        # that rate plus the debt and a bucket.
        calls, span = _calls_since(conn, run.flooder, run.started)
        print(f"figures: A's calls since B came: {calls} in {span:.1f} s (fair share"
              f" {PER_SECOND:.1f}/s, debt bound {PER_SECOND * DEBT_SECONDS:.0f} calls)")
        assert calls <= PER_SECOND * (span + DEBT_SECONDS) * 1.1 + 3, (calls, span)
        waited = _waited_for_quota(conn, run.flood)
        print(f"figures: A's interactive jobs that waited unclaimed (token_quota): {waited}")
        assert waited > 0
        _wait_resumed(conn, run.flood)
    stats = fake_stats(provider_url)
    assert stats["status_counts"].get("429", 0) <= 0.01 * stats["calls"], stats
