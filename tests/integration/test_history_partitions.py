"""The partitioned history (migrations 0029-0032): the migration keeps an existing database's
history, and retention drops a time partition whole only once every job in it is past
retention."""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from calmq import sql
from calmq.data import Store
from calmq.data.attempts import Finish
from calmq.data.migrations import apply_pending
from calmq.objects import open_object_store
from calmq.producers.retention import Sweeper
from calmq.settings import Settings
from calmq.tooling.devstack import StackState

pytestmark = pytest.mark.integration

RETENTION = 7 * 86400.0



def _tenant(conn: psycopg.Connection[Any]) -> uuid.UUID:
    tenant = uuid.uuid4()
    conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)", (tenant, f"t-{tenant.hex}"))
    return tenant


def _job(conn: psycopg.Connection[Any], tenant: uuid.UUID, *, status: str,
         created: datetime, updated: datetime) -> uuid.UUID:
    """A job with the history a completed one leaves, written at its creation."""
    job = uuid.uuid4()
    conn.execute(
        "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool,"
        " step, attempt, max_attempts, input, metadata, created_at, updated_at)"
        " VALUES (%s, %s, 'summarize', 1, %s, 'bulk', 'default', 'summarize', 1, 3,"
        " '{\"text\": \"secret\"}', '{\"order\": \"42\"}', %s, %s)",
        (job, tenant, status, created, updated))
    for offset, kind in enumerate(("queued", "running", "completed")):
        conn.execute("INSERT INTO job_events (job_id, type, at, attempt, detail)"
                     " VALUES (%s, %s, %s, 1, '{\"note\": \"secret\"}')",
                     (job, kind, created + timedelta(seconds=offset)))
    conn.execute("INSERT INTO job_attempts (job_id, step, attempt, worker, started_at,"
                 " finished_at, outcome, lease_version)"
                 " VALUES (%s, 'summarize', 1, 'w1', %s, %s, 'succeeded', 1)",
                 (job, created + timedelta(seconds=1), created + timedelta(seconds=2)))
    return job


def _history(conn: psycopg.Connection[Any], jobs: list[uuid.UUID]) -> tuple[int, int]:
    events = conn.execute("SELECT count(*) FROM job_events WHERE job_id = ANY(%s)",
                          (jobs,)).fetchone()
    attempts = conn.execute("SELECT count(*) FROM job_attempts WHERE job_id = ANY(%s)",
                            (jobs,)).fetchone()
    assert events is not None
    assert attempts is not None
    return int(events[0]), int(attempts[0])


def _partitions(conn: psycopg.Connection[Any]) -> set[str]:
    rows = conn.execute("SELECT c.relname FROM pg_inherits i JOIN pg_class c"
                        " ON c.oid = i.inhrelid WHERE i.inhparent IN"
                        " ('job_events'::regclass, 'job_attempts'::regclass)").fetchall()
    return {r[0] for r in rows}


def test_partitioning_migration_keeps_the_history_of_an_existing_database(
        fresh_db: str) -> None:
    """A database migrated up to before 0029, holding jobs with history, keeps every history
    row through 0029-0032 (now the first partition), and takes new history afterwards."""
    before = [(v, n, text) for v, n, text in sql.migrations() if v < 29]
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("CREATE TABLE calmq_migrations (version integer PRIMARY KEY,"
                     " name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")
        for version, name, text in before:
            with conn.transaction():
                conn.execute(text.encode())
                conn.execute("INSERT INTO calmq_migrations (version, name) VALUES (%s, %s)",
                             (version, name))
        tenant = _tenant(conn)
        now = datetime.now(UTC)
        jobs = [_job(conn, tenant, status="completed", created=now - timedelta(days=d),
                     updated=now - timedelta(days=d)) for d in (40, 3, 0)]
        assert _history(conn, jobs) == (9, 3)

    applied = [m.version for m in apply_pending(fresh_db)]
    assert applied == [v for v, _, _ in sql.migrations() if v >= 29]

    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert _history(conn, jobs) == (9, 3)
        legacy = conn.execute("SELECT count(*) FROM job_events_legacy").fetchone()
        assert legacy == (9,)
        assert {"job_events_legacy", "job_attempts_legacy"} <= _partitions(conn)
        # Partitions ahead of the cutover exist, and new history lands.
        assert len(_partitions(conn)) > 2
        newer = _job(conn, tenant, status="completed", created=datetime.now(UTC),
                     updated=datetime.now(UTC))
        assert _history(conn, [newer]) == (3, 1)
        row = conn.execute("SELECT max(id) > 0 FROM job_events").fetchone()
        assert row == (True,)


def _day_partitions_from(conn: psycopg.Connection[Any], day: datetime, ahead_days: int) -> None:
    """A database whose history partitions reach back to ``day``: the migration's partitions
    (empty here) give way to day partitions, made forward by the housekeeping's function."""
    for part in _partitions(conn):
        conn.execute(f"DROP TABLE {part}".encode())
    for parent in ("job_events", "job_attempts"):
        conn.execute(
            f"CREATE TABLE {parent}_{day:%Y%m%d}_0000 PARTITION OF {parent}"
            f" FOR VALUES FROM ('{day.isoformat()}') TO"
            f" ('{(day + timedelta(days=1)).isoformat()}')".encode())
    conn.execute("SELECT calmq_history_partitions(%s, interval '1 day')",
                 (timedelta(days=ahead_days),))


async def _sweep(url: str, objects_url: str) -> dict[str, int]:
    settings = Settings(database_url=url, object_store_url=objects_url,
                        job_retention_seconds=RETENTION)
    store = Store(url, max_size=2)
    await store.open()
    try:
        return await Sweeper(settings, store, open_object_store(objects_url)).sweep()
    finally:
        await store.close()


def test_retention_drops_a_partition_once_every_job_in_it_is_past_retention(
        fresh_db: str, stack: StackState) -> None:
    """A day partition holding a job past retention and one still within it stays (the
    first job's rows deleted from it); once the second is past retention too, the sweep
    redacts it and drops the partition with its history rows, and the newer partitions
    stay."""
    apply_pending(fresh_db)
    objects_url = stack.env["CALMQ_OBJECT_STORE_URL"]
    now = datetime.now(UTC)
    day = (now - timedelta(days=10)).replace(hour=0, minute=0, second=0, microsecond=0)
    old_part = f"job_events_{day:%Y%m%d}_0000"
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        _day_partitions_from(conn, day, ahead_days=3)
        tenant = _tenant(conn)
        expired = _job(conn, tenant, status="completed", created=day + timedelta(hours=1),
                       updated=now - timedelta(days=8))
        recent = _job(conn, tenant, status="completed", created=day + timedelta(hours=2),
                      updated=now - timedelta(days=1))
        fresh = _job(conn, tenant, status="completed", created=now - timedelta(hours=1),
                     updated=now - timedelta(hours=1))

    first = asyncio.run(_sweep(fresh_db, objects_url))
    assert first["jobs"] == 1
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert old_part in _partitions(conn)  # `recent` still needs its history
        assert _history(conn, [expired]) == (0, 0)  # and only `recent`
        assert _history(conn, [recent]) == (3, 1)
        conn.execute("UPDATE jobs SET updated_at = now() - interval '8 days' WHERE id = %s",
                     (recent,))

    second = asyncio.run(_sweep(fresh_db, objects_url))
    assert second["jobs"] == 1
    assert second["partitions_dropped"] >= 2  # that day's job_events and job_attempts
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert old_part not in _partitions(conn)
        assert _history(conn, [expired, recent]) == (0, 0)
        assert _history(conn, [fresh]) == (3, 1)
        redacted = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s)"
                                " AND redacted_at IS NOT NULL AND input IS NULL",
                                ([expired, recent],)).fetchone()
        assert redacted == (2,)


def test_one_tenants_old_open_job_does_not_keep_another_tenants_history(
        fresh_db: str, stack: StackState) -> None:
    """Tenant B's job open since ten days ago holds its partition back, yet tenant A's job of
    that day, past retention, loses its history rows at the sweep; B's rows stay."""
    apply_pending(fresh_db)
    now = datetime.now(UTC)
    day = (now - timedelta(days=10)).replace(hour=0, minute=0, second=0, microsecond=0)
    old_part = f"job_events_{day:%Y%m%d}_0000"
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        _day_partitions_from(conn, day, ahead_days=3)
        a, b = _tenant(conn), _tenant(conn)
        gone = _job(conn, a, status="completed", created=day + timedelta(hours=1),
                    updated=now - timedelta(days=9))
        open_job = _job(conn, b, status="awaiting_review", created=day + timedelta(hours=2),
                        updated=now)

    swept = asyncio.run(_sweep(fresh_db, stack.env["CALMQ_OBJECT_STORE_URL"]))
    assert swept["jobs"] == 1
    assert swept["history_rows_expired"] == 4  # A's three events and its attempt
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert old_part in _partitions(conn)  # B's job still needs its history
        assert _history(conn, [gone]) == (0, 0)
        assert _history(conn, [open_job]) == (3, 1)


def test_a_finish_reads_only_the_attempt_partitions_from_its_jobs_creation_on(
        fresh_db: str) -> None:
    """finish_attempts closes the attempt row through the partitions that can hold it (from
    its job's creation on), pruned at run time: with ten days of partitions, the older ones
    are never scanned. (Compared with a bound from a second relation, the bound was a join
    filter, and every finish probed every day's partition of the retention.)"""
    apply_pending(fresh_db)
    now = datetime.now(UTC)
    first_day = (now - timedelta(days=10)).replace(hour=0, minute=0, second=0, microsecond=0)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        _day_partitions_from(conn, first_day, ahead_days=2)
        tenant = _tenant(conn)
        job = _job(conn, tenant, status="running", created=now - timedelta(minutes=5),
                   updated=now)
        conn.execute("UPDATE jobs SET lease_owner = 'w1', lease_version = 1, attempt = 2,"
                     " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (job,))
        conn.execute("INSERT INTO job_attempts (job_id, step, attempt, worker, started_at,"
                     " lease_version) VALUES (%s, 'summarize', 2, 'w1', now(), 1)", (job,))

    finish = Finish(job_id=job, worker="w1", step="summarize", attempt=2, status="completed",
                    event_type="completed", outcome="succeeded", lease_version=1)
    with psycopg.connect(fresh_db) as conn:  # rolled back: EXPLAIN ANALYZE runs it
        rows = conn.execute(b"EXPLAIN (ANALYZE, COSTS OFF) "
                            + sql.queries()["finish_attempts"].encode(),
                            {"rows": Jsonb([finish.row(0)]), "keep_errors": 10}).fetchall()
        plan = "\n".join(r[0] for r in rows)
        outcome = conn.execute("SELECT outcome FROM job_attempts WHERE job_id = %s"
                               " AND attempt = 2", (job,)).fetchone()
        conn.rollback()
    assert outcome == ("succeeded",), plan  # the attempt row was found and closed
    scans = dict(re.findall(r"Scan (?:using \w+ )?on job_attempts_(\d{8})_0000 \w+"
                            r"[^\n]*?(never executed|actual)", plan))
    assert len(scans) >= 12, plan  # the ten days behind, today and the days ahead
    job_day = f"{now - timedelta(minutes=5):%Y%m%d}"
    scanned = {day for day, how in scans.items() if how == "actual"}
    assert scanned, plan
    assert min(scanned) >= job_day, plan
    assert f"{now:%Y%m%d}" in scanned, plan
