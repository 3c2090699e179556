"""Service tiers on the real stack (issue 46 items 1 and 2): a worker with
CALMQ_SERVICE_TIERS=flex against the fake provider, whose flex tier refuses every second
call for capacity. Bulk jobs with time to spare are sent at flex; each refused flex call is
served at the standard tier in the same attempt (one attempt, no retry); interactive jobs
go at the standard tier; the history names each call's chosen and served tier; a flex call
costs half the standard one; a job that ends past its deadline is named in its history and
counted in the worker's metrics."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from calmq.tooling.devstack import StackState, processes
from tests.support.waiting import wait_for
from tests.support.workers import (
    Procs,
    all_completed,
    create_pool_topics,
    create_tenant_id,
    fake_stats,
    history,
    job_rows,
    metric,
    start_fake_provider,
    submit,
)

pytestmark = pytest.mark.integration

MODEL = "gpt-5-mini"
TEXT = "Flex is half the price of the standard tier, and slower."


@dataclass
class Rig:
    db: str
    provider: str
    pool: str
    port: int
    tenant: uuid.UUID


@pytest.fixture(scope="module")
def rig(stack: StackState) -> Iterator[Rig]:
    log_dir = Path(tempfile.mkdtemp(prefix="calmq-tiers-logs-"))
    procs = Procs(stack.env, log_dir)
    pid, url = start_fake_provider(log_dir, "--latency-ms", "20", "--flex-latency-ms", "100",
                                   "--flex-refusal-rate", "0.5")
    try:
        pool = f"tiers{uuid.uuid4().hex[:6]}"
        create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], pool, ["1s"])
        _proc, port = procs.worker(
            pool, concurrency="8", provider_url=url, model=MODEL, retry_tiers="1s",
            service_tiers="flex", service_tier_flex_seconds="0.5",
            service_tier_standard_seconds="0.2")
        db = stack.env["CALMQ_DATABASE_URL"]
        tenant, _key = create_tenant_id(db, f"tiers-{uuid.uuid4().hex[:8]}")
        yield Rig(db, url, pool, port, tenant)
    finally:
        procs.stop_all()
        processes.stop(pid)


def _tiers(db: str, job_id: str) -> list[dict[str, Any]]:
    return [t for e in history(db, job_id) for t in (e["detail"] or {}).get("tiers", [])]


def _run(rig: Rig, n: int, *, priority: str, seconds: float,
         data: dict[str, Any] | None = None) -> list[str]:
    ids = submit(rig.db, rig.tenant, rig.pool, [dict(data or {"text": TEXT})] * n,
                 priority=priority, deadline_at=datetime.now(UTC) + timedelta(seconds=seconds))
    with psycopg.connect(rig.db, autocommit=True) as conn:
        wait_for(lambda: all_completed(conn, ids), timeout=60, what=f"{priority} jobs")
    return ids


def test_bulk_jobs_go_flex_and_refusals_move_to_standard_in_the_same_attempt(
        rig: Rig) -> None:
    """Eight bulk jobs with a minute to spare: all chosen flex, half refused by the fake and
    served at standard at once; every job one attempt, no retry; a flex-served job costs
    half what a standard-served one does."""
    before = fake_stats(rig.provider)
    ids = _run(rig, 8, priority="bulk", seconds=60)
    calls = {i: _tiers(rig.db, i) for i in ids}
    assert all(len(c) == 1 and c[0]["chosen"] == "flex" for c in calls.values()), calls
    moved = [c[0] for c in calls.values() if "moved" in c[0]]
    served_flex = [i for i, c in calls.items() if c[0]["served"] == "flex"]
    assert len(moved) == 4
    assert all(m["moved"] == "flex_refused" and m["served"] == "standard"
               and m["moved_ms"] < 1000 for m in moved)
    assert len(served_flex) == 4
    after = fake_stats(rig.provider)
    assert after["flex_refused"] - before.get("flex_refused", 0) == 4
    assert "priority" not in after["by_tier"]
    rows = job_rows(rig.db, ids)
    assert all(r["attempt"] == 1 and r["status"] == "completed" for r in rows.values())
    for i in ids:
        assert "retry_scheduled" not in [e["type"] for e in history(rig.db, i)]
    with psycopg.connect(rig.db) as conn:
        costs = dict(conn.execute("SELECT id::text, cost_usd FROM jobs WHERE id = ANY(%s::uuid[])",
                                  (ids,)).fetchall())
    flex = [float(costs[i]) for i in served_flex]
    standard = [float(costs[i]) for i in ids if i not in served_flex]
    assert min(flex) > 0
    assert max(flex) == pytest.approx(min(standard) / 2, rel=0.05)


def test_interactive_jobs_go_at_the_standard_tier(rig: Rig) -> None:
    """Interactive jobs are sent at the standard tier however long their deadline; the time
    a call has is bounded by its step's timeout (60 s) as well as by the deadline."""
    ids = _run(rig, 3, priority="interactive", seconds=600)
    for i in ids:
        calls = _tiers(rig.db, i)
        assert [{k: v for k, v in c.items() if k != "left_s"} for c in calls] == [
            {"model": MODEL, "chosen": "standard", "served": "standard"}]
        assert 50 < calls[0]["left_s"] <= 60


def test_a_job_ending_past_its_deadline_is_named_and_counted(rig: Rig) -> None:
    """A job whose model call outlasts its deadline completes late: its last event names
    the missed deadline, and the worker counts it."""
    before = metric(rig.port, "calmq_deadlines_missed_total") or 0.0
    ids = submit(rig.db, rig.tenant, rig.pool, [{"text": TEXT, "delay_ms": 2500}],
                 priority="bulk", deadline_at=datetime.now(UTC) + timedelta(seconds=2))
    with psycopg.connect(rig.db, autocommit=True) as conn:
        wait_for(lambda: conn.execute(
            "SELECT status IN ('completed', 'dead_letter') FROM jobs WHERE id = %s",
            (ids[0],)).fetchone()[0], timeout=60, what="the late job to end")
    last = history(rig.db, ids[0])[-1]
    assert last["type"] in ("completed", "dead_lettered")
    assert last["detail"]["deadline_missed"]["late_seconds"] >= 0
    wait_for(lambda: (metric(rig.port, "calmq_deadlines_missed_total") or 0.0) > before,
             timeout=10, what="calmq_deadlines_missed_total")
