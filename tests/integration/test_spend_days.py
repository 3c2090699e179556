"""What tenants spent, kept per day as attempts' cost is written (migrations 0038-0039): the
spend caps read the same sums as the month's attempts give, across the migration of a
database that already holds attempts, a cost written between its two files, and the folds
of the deltas into their days."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from calmq import sql
from calmq.data import Store
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
        conn.execute("DROP TABLE spend_days, spend_deltas")
        conn.execute("DELETE FROM calmq_migrations WHERE version IN (38, 39)")
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

    assert [m.version for m in apply_pending(fresh_db)] == [39]

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
