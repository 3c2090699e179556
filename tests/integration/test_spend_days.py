"""What tenants spent, kept per day (migrations 0038-0039) and per hour (0040-0041) as
attempts' usage is written: the spend caps and the console's overview read the same sums as
the attempts give, across the migration of a database that already holds attempts, usage
written between the two files, and the folds of the deltas."""

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
from calmq.data.spending import Spend, SpendLedger

pytestmark = pytest.mark.integration

# The definition the rollup must agree with: the cost of the attempts started this UTC
# month (and day), per tenant.
_FROM_ATTEMPTS = """
SELECT j.tenant_id,
       coalesce(sum(a.cost_usd) FILTER (
           WHERE a.started_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'),
           0)::float8 AS day,
       coalesce(sum(a.cost_usd), 0)::float8 AS month
FROM job_attempts a JOIN jobs j ON j.id = a.job_id
WHERE a.started_at >= date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
  AND a.cost_usd > 0
GROUP BY j.tenant_id
"""


def _from_attempts(conn: psycopg.Connection[Any]) -> dict[uuid.UUID, Spend]:
    return {r[0]: Spend(r[1], r[2]) for r in conn.execute(_FROM_ATTEMPTS).fetchall()}


def _attempt(conn: psycopg.Connection[Any], tenant: uuid.UUID, started: datetime,
             cost: float) -> uuid.UUID:
    """A job with one attempt, its cost written as a finish writes it (an UPDATE)."""
    job = uuid.uuid4()
    conn.execute(
        "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool,"
        " step, attempt, max_attempts, input, created_at, updated_at)"
        " VALUES (%s, %s, 'summarize', 1, 'running', 'bulk', 'default', 'summarize', 1, 3,"
        " '{}', %s, %s)", (job, tenant, started, started))
    conn.execute("INSERT INTO job_attempts (job_id, step, attempt, worker, started_at,"
                 " lease_version) VALUES (%s, 'summarize', 1, 'w1', %s, 1)", (job, started))
    _charge(conn, job, cost)
    return job


def _charge(conn: psycopg.Connection[Any], job: uuid.UUID, cost: float) -> None:
    conn.execute("UPDATE job_attempts SET cost_usd = cost_usd + %s WHERE job_id = %s",
                 (cost, job))


def _spent(url: str, *, fold: bool = False) -> dict[uuid.UUID, Spend]:
    async def run() -> dict[uuid.UUID, Spend]:
        store = Store(url, max_size=2)
        await store.open()
        try:
            ledger = SpendLedger(store)
            if fold:  # the release pass folds the deltas (nothing waits to release)
                await ledger.release(held_bulk=[], held_all=[], fleet_bulk=False,
                                     fleet_all=False)
            return await ledger.spend()
        finally:
            await store.close()

    return asyncio.run(run())


def test_the_spend_caps_read_what_the_months_attempts_cost_across_the_migration(
        fresh_db: str) -> None:
    """A database holding this month's and last month's attempts, migrated to 0038 (the
    trigger); an attempt charged before 0039 (the backfill) is counted once; so is one
    charged after, before and after the deltas are folded into their days."""
    apply_pending(fresh_db)
    migrations = {v: text for v, _, text in sql.migrations()}
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        # The database as it was before the rollup (0038 and 0039 undone), in use: attempts
        # of this month and of the last, with their cost written.
        conn.execute("DROP TRIGGER job_attempts_spend ON job_attempts")
        conn.execute("DROP FUNCTION calmq_spend_deltas()")
        conn.execute("DROP TABLE spend_days, spend_deltas, spend_hours, spend_hour_deltas")
        conn.execute("DELETE FROM calmq_migrations WHERE version IN (38, 39, 40, 41)")
        a, b = uuid.uuid4(), uuid.uuid4()
        for tenant in (a, b):
            conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)",
                         (tenant, f"t-{tenant.hex}"))
        now = datetime.now(UTC)
        _attempt(conn, a, now, 0.25)
        _attempt(conn, a, now - timedelta(days=40), 7.0)  # last month: not counted
        running = _attempt(conn, b, now, 0.5)
        with conn.transaction():
            conn.execute(migrations[38].encode())
            conn.execute("INSERT INTO calmq_migrations (version, name) VALUES (38, 'spend_days')")
        _charge(conn, running, 0.125)  # between 0038 and 0039: a delta, and in the attempt
        deltas = conn.execute("SELECT count(*) FROM spend_deltas").fetchone()
        assert deltas == (1,)

    assert [m.version for m in apply_pending(fresh_db)] == [39, 40, 41]

    with psycopg.connect(fresh_db, autocommit=True) as conn:
        expected = _from_attempts(conn)
    assert expected[a].month == pytest.approx(0.25)
    assert expected[b].month == pytest.approx(0.625)
    assert _spent(fresh_db) == expected
    assert _spent(fresh_db, fold=True) == expected
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM spend_deltas").fetchone() == (0,)
        _charge(conn, running, 1.0)  # after the fold: a new delta
        expected = _from_attempts(conn)
    assert expected[b].month == pytest.approx(1.625)
    assert _spent(fresh_db) == expected
    assert _spent(fresh_db, fold=True) == expected


# The definition the hourly rollup must agree with: the console's spend as it read the
# attempts of the window before 0040, per UTC hour (what dead-lettered jobs cost is
# tests/integration/test_finish_bins.py's).
_HOURS_FROM_ATTEMPTS = """
SELECT date_trunc('hour', a.started_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS hour,
       sum(a.input_tokens + a.output_tokens)::bigint AS tokens,
       sum(a.cost_usd)::float8 AS cost_usd,
       coalesce(sum(a.cost_usd) FILTER (WHERE a.outcome IS DISTINCT FROM 'completed'),
                0)::float8 AS retry_cost_usd
FROM job_attempts a JOIN jobs j ON j.id = a.job_id
WHERE a.started_at >= date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                      - interval '23 hours'
  AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid)
GROUP BY 1
HAVING sum(a.input_tokens + a.output_tokens) <> 0 OR sum(a.cost_usd) <> 0
ORDER BY 1
"""

_Hours = list[tuple[datetime, int, float, float]]


def _rounded(rows: Any) -> _Hours:
    return [(r["hour"], int(r["tokens"]), round(r["cost_usd"], 6),
             round(r["retry_cost_usd"], 6)) for r in rows]


def _hours_from_attempts(url: str, tenant: uuid.UUID | None) -> _Hours:
    with psycopg.connect(url, row_factory=dict_row) as conn:
        return _rounded(conn.execute(_HOURS_FROM_ATTEMPTS, {"tenant_id": tenant}).fetchall())


def _console_hours(url: str, tenant: uuid.UUID | None, *, fold: bool = False) -> _Hours:
    async def run() -> _Hours:
        store = Store(url, max_size=2)
        await store.open()
        try:
            if fold:
                await SpendLedger(store).release(held_bulk=[], held_all=[], fleet_bulk=False,
                                                 fleet_all=False)
            return _rounded((await ConsoleReads(store).overview(tenant)).spend)
        finally:
            await store.close()

    return asyncio.run(run())


def _use(conn: psycopg.Connection[Any], job: uuid.UUID, *, tokens: int, cost: float,
         outcome: str | None) -> None:
    """Usage and outcome written as a finish writes them (an UPDATE of the attempt)."""
    conn.execute("UPDATE job_attempts SET input_tokens = input_tokens + %s,"
                 " output_tokens = output_tokens + 1, cost_usd = cost_usd + %s, outcome = %s"
                 " WHERE job_id = %s", (tokens - 1, cost, outcome, job))


def test_the_consoles_hours_read_what_the_attempts_used_across_the_migration(
        fresh_db: str) -> None:
    """A database before the hourly rollup (0040 and 0041 undone) holding attempts that
    completed, failed, belong to a dead letter or fall outside the 24 hours; usage written
    between 0040 and 0041, a fold, then an outcome changed: the console's tokens, cost and
    retry cost per hour stay what the attempts give, per tenant and for the platform."""
    apply_pending(fresh_db)
    migrations = {v: text for v, _, text in sql.migrations()}
    function_0038 = migrations[38][migrations[38].index("CREATE FUNCTION"):
                                   migrations[38].index("CREATE TRIGGER")]
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("DROP TABLE spend_hours, spend_hour_deltas")
        conn.execute(function_0038.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION",
                                           1).encode())
        conn.execute("DELETE FROM calmq_migrations WHERE version IN (40, 41)")
        a, b = uuid.uuid4(), uuid.uuid4()
        for tenant in (a, b):
            conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)",
                         (tenant, f"t-{tenant.hex}"))
        now = datetime.now(UTC)
        _use(conn, _attempt(conn, a, now, 0.0), tokens=100, cost=0.25, outcome="completed")
        _use(conn, _attempt(conn, a, now - timedelta(hours=3), 0.0), tokens=50, cost=0.1,
             outcome="failed")
        dead = _attempt(conn, a, now - timedelta(hours=2), 0.0)
        _use(conn, dead, tokens=30, cost=0.2, outcome="failed")
        conn.execute("UPDATE jobs SET status = 'dead_letter', updated_at = now() WHERE id = %s",
                     (dead,))
        _use(conn, _attempt(conn, a, now - timedelta(hours=30), 0.0), tokens=1000, cost=7.0,
             outcome="completed")  # before the window
        running = _attempt(conn, b, now, 0.0)
        with conn.transaction():
            conn.execute(migrations[40].encode())
            conn.execute("INSERT INTO calmq_migrations (version, name)"
                         " VALUES (40, 'spend_hours')")
        # Between 0040 and 0041: a delta, and in the attempt.
        _use(conn, running, tokens=40, cost=0.5, outcome="completed")
        assert conn.execute("SELECT count(*) FROM spend_hour_deltas").fetchone() == (1,)

    assert [m.version for m in apply_pending(fresh_db)] == [41]

    expected = {t: _hours_from_attempts(fresh_db, t) for t in (a, b, None)}
    assert sum(h[1] for h in expected[a]) == 180
    assert sum(h[3] for h in expected[None]) == pytest.approx(0.3)
    assert sum(h[2] for h in expected[b]) == pytest.approx(0.5)
    for tenant in (a, b, None):
        assert _console_hours(fresh_db, tenant) == expected[tenant]
    assert _console_hours(fresh_db, None, fold=True) == expected[None]
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM spend_hour_deltas").fetchone() == (0,)
        # After the fold: the outcome alone changes (the attempt failed after all), so its
        # cost moves to the retries' share.
        conn.execute("UPDATE job_attempts SET outcome = 'failed' WHERE job_id = %s", (running,))
    expected = {t: _hours_from_attempts(fresh_db, t) for t in (a, b, None)}
    assert sum(h[3] for h in expected[b]) == pytest.approx(0.5)
    for tenant in (a, b, None):
        assert _console_hours(fresh_db, tenant) == expected[tenant]
