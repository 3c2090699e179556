"""Jobs finished per tenant and 5 minutes, kept as their history is written (migrations
0042-0043): the console overview's throughput and what the jobs dead-lettered in each hour
cost read the same as the history gives, across the migration of a database that already
holds finished jobs, a job finished between its two files, and the folds of the deltas."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from calmq import sql
from calmq.data import Store
from calmq.data.console import ConsoleReads
from calmq.data.migrations import apply_pending
from calmq.data.spending import SpendLedger

pytestmark = pytest.mark.integration

# The definitions the bins must agree with: the console's statements as they read the
# history before 0042 (the throughput over the same 12 bins the chart shows; the cost of the
# jobs dead-lettered per UTC hour of the last 24).
_OUTCOMES_FROM_HISTORY = """
SELECT date_bin('5 minutes', e.at, 'epoch'::timestamptz) AS bin, e.type, count(*) AS jobs
FROM job_events e JOIN jobs j ON j.id = e.job_id
WHERE e.type IN ('completed', 'dead_lettered')
  AND e.at >= date_bin('5 minutes', now(), 'epoch'::timestamptz) - interval '55 minutes'
  AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid)
GROUP BY 1, 2
ORDER BY 1, 2
"""
_DEAD_COST_FROM_HISTORY = """
SELECT date_trunc('hour', e.at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS hour,
       sum(j.cost_usd)::float8 AS dead_letter_cost_usd
FROM job_events e JOIN jobs j ON j.id = e.job_id
WHERE e.type = 'dead_lettered'
  AND e.at >= date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
              - interval '23 hours'
  AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid)
GROUP BY 1
ORDER BY 1
"""

_Read = tuple[list[tuple[datetime, str, int]], list[tuple[datetime, float]]]


def _from_history(url: str, tenant: uuid.UUID | None) -> _Read:
    with psycopg.connect(url, row_factory=dict_row) as conn:
        outcomes = conn.execute(_OUTCOMES_FROM_HISTORY, {"tenant_id": tenant}).fetchall()
        dead = conn.execute(_DEAD_COST_FROM_HISTORY, {"tenant_id": tenant}).fetchall()
    return ([(r["bin"], r["type"], int(r["jobs"])) for r in outcomes],
            [(r["hour"], round(r["dead_letter_cost_usd"], 6)) for r in dead])


def _console(url: str, tenant: uuid.UUID | None, *, fold: bool = False) -> _Read:
    async def run() -> _Read:
        store = Store(url, max_size=2)
        await store.open()
        try:
            if fold:  # the release pass folds the deltas (nothing waits to release)
                await SpendLedger(store).release(held_bulk=[], held_all=[], fleet_bulk=False,
                                                 fleet_all=False)
            view = await ConsoleReads(store).overview(tenant)
        finally:
            await store.close()
        outcomes = sorted((r["bin"], r["type"], int(r["jobs"])) for r in view.outcomes)
        dead = [(r["hour"], round(r["dead_letter_cost_usd"], 6)) for r in view.spend
                if r["dead_letter_cost_usd"]]
        return outcomes, dead

    return asyncio.run(run())


def _finished(conn: psycopg.Connection[Any], tenant: uuid.UUID, at: datetime, type_: str,
              cost: float) -> uuid.UUID:
    """A job that ended at ``at`` (its history's completed or dead_lettered event, written
    after the job's cost as a finish writes them)."""
    job = uuid.uuid4()
    status = "completed" if type_ == "completed" else "dead_letter"
    conn.execute(
        "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool,"
        " step, attempt, max_attempts, input, cost_usd, created_at, updated_at)"
        " VALUES (%s, %s, 'summarize', 1, %s, 'bulk', 'default', 'summarize', 1, 3, '{}', %s,"
        " %s, %s)", (job, tenant, status, cost, at - timedelta(seconds=5), at))
    conn.execute("INSERT INTO job_events (job_id, type, at, attempt) VALUES (%s, %s, %s, 1)",
                 (job, type_, at))
    return job


def test_the_consoles_throughput_and_dead_letter_cost_read_the_history_across_the_migration(
        fresh_db: str) -> None:
    """A database before the bins (0042 and 0043 undone) holding jobs completed and
    dead-lettered inside the last hour, earlier in the day and two days ago, for two
    tenants; a job dead-lettered between 0042 and 0043; a fold; then one more: the console's
    jobs per 5 minutes and dead-letter cost per hour stay what the history gives, per tenant
    and for the platform."""
    apply_pending(fresh_db)
    migrations = {v: text for v, _, text in sql.migrations()}
    function_0009 = migrations[9][migrations[9].index("CREATE OR REPLACE FUNCTION"):]
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("DROP TABLE finish_bins, finish_bin_deltas")
        conn.execute(function_0009.encode())
        conn.execute("DELETE FROM calmq_migrations WHERE version IN (42, 43)")
        a, b = uuid.uuid4(), uuid.uuid4()
        for tenant in (a, b):
            conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)",
                         (tenant, f"t-{tenant.hex}"))
        now = datetime.now(UTC)
        _finished(conn, a, now, "completed", 0.25)
        _finished(conn, a, now - timedelta(minutes=20), "completed", 0.1)
        _finished(conn, a, now - timedelta(minutes=10), "dead_lettered", 0.5)
        _finished(conn, a, now - timedelta(hours=3), "dead_lettered", 0.7)
        _finished(conn, a, now - timedelta(days=2), "dead_lettered", 9.0)  # before the window
        _finished(conn, b, now, "completed", 0.05)
        with conn.transaction():
            conn.execute(migrations[42].encode())
            conn.execute("INSERT INTO calmq_migrations (version, name)"
                         " VALUES (42, 'finish_bins')")
        # Between 0042 and 0043: a delta, and in the history.
        _finished(conn, b, now, "dead_lettered", 0.3)
        assert conn.execute("SELECT count(*) FROM finish_bin_deltas").fetchone() == (1,)

    assert [m.version for m in apply_pending(fresh_db)] == [43]

    expected = {t: _from_history(fresh_db, t) for t in (a, b, None)}
    assert sum(n for _, _, n in expected[a][0]) == 3
    assert sum(c for _, c in expected[a][1]) == pytest.approx(1.2)
    assert sum(n for _, kind, n in expected[None][0] if kind == "dead_lettered") == 2
    for tenant in (a, b, None):
        assert _console(fresh_db, tenant) == expected[tenant]
    assert _console(fresh_db, None, fold=True) == expected[None]
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM finish_bin_deltas").fetchone() == (0,)
        _finished(conn, a, datetime.now(UTC), "dead_lettered", 0.125)  # after the fold
    expected = {t: _from_history(fresh_db, t) for t in (a, b, None)}
    assert sum(c for _, c in expected[a][1]) == pytest.approx(1.325)
    for tenant in (a, b, None):
        assert _console(fresh_db, tenant) == expected[tenant]
