"""The tables' health gauges against the real PostgreSQL: dead tuples follow deletes (a
partitioned table's partitions counted under its own name), an open transaction's age is
seen, and the API exports the gauges the alert rules read."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from calmq.data import Database
from calmq.data.observability import TableHealth, table_health, transaction_ages
from calmq.tooling.devstack import StackState
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.integration


@pytest.fixture
def scratch_table(stack: StackState) -> Iterator[str]:
    """A table of calmq's schema with 2,000 rows, 1,500 of them deleted, that autovacuum
    leaves alone (so its dead tuples stay until the test has read them); dropped after."""
    url = stack.env["CALMQ_DATABASE_URL"]
    name = f"calmq_test_bloat_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (n int) WITH (autovacuum_enabled = false)".encode())
        conn.execute(f"INSERT INTO {name} SELECT generate_series(1, 2000)".encode())
        conn.execute(f"DELETE FROM {name} WHERE n > 500".encode())
    try:
        yield name
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {name}".encode())


async def test_dead_tuples_follow_deletes_and_partitions_count_under_their_table(
    db: Database, scratch_table: str,
) -> None:
    """The deleted rows are reported dead (3/4 of the table) until a vacuum reclaims them;
    job_events and job_attempts are one row each, never a row per partition."""

    async def counted() -> TableHealth | None:
        found = {t.table: t for t in await table_health(db)}.get(scratch_table)
        return found if found is not None and found.dead >= 1500 else None

    # The statistics are flushed by each backend within a second or so of its transaction.
    bloated = await wait_for_async(counted, within=30, what="the deletes in the statistics")
    assert bloated.dead == 1500
    assert bloated.live == 500
    assert bloated.dead_ratio == pytest.approx(0.75)
    assert bloated.since_vacuum_seconds is None  # never vacuumed

    async with db.pool.connection() as conn:
        await conn.set_autocommit(True)
        await conn.execute(f"VACUUM {scratch_table}".encode())

    async def reclaimed() -> TableHealth | None:
        found = {t.table: t for t in await table_health(db)}[scratch_table]
        return found if found.dead == 0 and found.since_vacuum_seconds is not None else None

    await wait_for_async(reclaimed, within=30, what="the vacuum in the statistics")

    async with db.pool.connection() as conn:
        cur = await conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid")
        partitions = {str(r["relname"]) for r in await cur.fetchall()}
    names = [t.table for t in await table_health(db)]
    assert partitions, "the history tables are partitioned"
    assert {"jobs", "job_events", "job_attempts", "outbox"} <= set(names)
    assert not partitions & set(names)
    assert len(names) == len(set(names))


async def test_an_open_transaction_and_the_xid_age_are_seen(
    stack: StackState, db: Database,
) -> None:
    """A transaction left open on another connection shows as the oldest one, for as long
    as it stays open; the database's XID age is positive and grows with transactions."""
    before = await transaction_ages(db)
    assert before.xid_age > 0
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as holder:
        holder.execute("SELECT txid_current()")  # an XID assigned, the transaction kept open

        async def held() -> float | None:
            seconds = (await transaction_ages(db)).oldest_transaction_seconds
            return seconds if seconds >= 1.0 else None

        assert await wait_for_async(held, within=30, what="the open transaction's age") >= 1.0
        holder.rollback()
    after = await transaction_ages(db)
    assert after.xid_age > before.xid_age  # txid_current() took one


async def test_a_listener_that_stops_reading_shows_in_the_notification_queue_usage(
    stack: StackState, db: Database,
) -> None:
    """A session that LISTENs and then sits in a transaction keeps every notification sent
    since in the NOTIFY queue: its usage reads above 0 until that session lets go."""
    url = stack.env["CALMQ_DATABASE_URL"]
    channel = f"calmq_test_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url) as listener:
        listener.execute(f"LISTEN {channel}".encode())
        listener.commit()
        listener.execute("SELECT 1")  # a transaction open: nothing is delivered to it
        with psycopg.connect(url, autocommit=True) as sender:
            for _ in range(40):  # 40 payloads of 7,900 bytes: dozens of the queue's pages
                sender.execute("SELECT pg_notify(%s, %s)", (channel, "x" * 7_900))
        assert (await transaction_ages(db)).notification_queue_usage > 0
        listener.rollback()


def test_the_api_exports_the_table_gauges(stack: StackState) -> None:
    """The API's /metrics has a dead-tuple series for each hot table and the database-wide
    gauges, sampled at its start (the rules in deploy/prometheus/alerts.yml read them)."""
    url = next(p.address for p in stack.parts if p.name == "api") + "/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    samples = [(s.name, dict(s.labels), float(s.value))
               for family in text_string_to_metric_families(text) for s in family.samples]
    tables = {ls["table"] for n, ls, _v in samples if n == "calmq_db_dead_tuple_ratio"}
    assert {"jobs", "job_events", "job_attempts", "outbox"} <= tables
    assert all(0.0 <= v <= 1.0 for n, _ls, v in samples if n == "calmq_db_dead_tuple_ratio")
    xid = [v for n, _ls, v in samples if n == "calmq_db_xid_age"]
    assert xid
    assert xid[0] > 0
    assert [n for n, _ls, _v in samples if n == "calmq_db_oldest_transaction_seconds"]
    usage = [v for n, _ls, v in samples if n == "calmq_db_notification_queue_usage"]
    assert usage
    assert 0.0 <= usage[0] <= 1.0
