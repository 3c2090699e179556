"""PostgreSQL failover in the middle of a run: the primary is killed with -9, the streaming
standby promoted, and the database address (a TCP proxy, as a cloud database's endpoint)
pointed at it; the relay streams on from the slot the standby synchronised.

The local stack's standby (`calmq dev up --standby`): ``pg_basebackup`` of the primary,
streaming through a physical slot, synchronous commit to it, ``sync_replication_slots = on``,
and on the primary ``synchronized_standby_slots`` naming it; the relay's slot is a failover
slot (``FAILOVER true``, PostgreSQL 17+). The failover waits until the standby holds a
persistent synchronised copy of the slot, as a failover manager would.

Checked after the load drained: every accepted job is there once (0 lost), none completed
twice, none stuck; every outbox row on the new primary is on its topic (0 outbox events
lost; duplicates allowed, consumers dedup by event id); the relay did not find its slot
lost (it resumed from the synchronised one). Figures: duplicates of outbox events, and the
time from the kill to the first job completed after it.

`make chaos` (CALMQ_CHAOS_FULL=1): 3,000 jobs. `make test`: 150.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from calmq.tooling.devstack import processes
from tests.support.chaos import (
    SETTLED,
    ChaosStack,
    Load,
    Results,
    lagging_partitions,
    new_tenant,
    rows_of,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.chaos

FULL = os.environ.get("CALMQ_CHAOS_FULL", "") not in ("", "0")
JOBS = 3000 if FULL else 150
LOAD_SECONDS = 90.0 if FULL else 10.0


def _first_completion_after(db: str, tenant: str, after: datetime) -> datetime | None:
    with psycopg.connect(db, connect_timeout=3) as conn:
        row = conn.execute(
            """SELECT min(e.at) FROM job_events e JOIN jobs j ON j.id = e.job_id
                 JOIN tenants t ON t.id = j.tenant_id
                WHERE t.name = %s AND e.type = 'completed' AND e.at > %s""",
            (tenant, after)).fetchone()
    return row[0] if row and row[0] is not None else None


def _completed_after(db: str, tenant: str, after: datetime) -> datetime | None:
    try:
        return _first_completion_after(db, tenant, after)
    except psycopg.OperationalError:
        return None  # the endpoint is still moving to the standby


def _published_ids(bootstrap: str) -> Counter[str]:
    """Every event id (header ``id``) on every calmq topic, counted."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"ids-{uuid.uuid4()}",
                         "enable.auto.commit": False})
    seen: Counter[str] = Counter()
    try:
        meta = consumer.list_topics(timeout=10).topics
        parts = [TopicPartition(t, p, 0) for t, m in meta.items() if t.startswith("calmq.")
                 for p in m.partitions]
        ends = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=10)[1]
                for tp in parts}
        consumer.assign(parts)
        left = {k for k, end in ends.items() if end > 0}
        while left:
            for msg in consumer.consume(5000, timeout=1.0):
                if msg.error():
                    continue
                key = (str(msg.topic()), int(msg.partition() or 0))
                event_id = dict(msg.headers() or []).get("id")
                if event_id is not None:
                    seen[event_id.decode()] += 1
                if (msg.offset() or 0) + 1 >= ends[key]:
                    left.discard(key)
    finally:
        consumer.close()
    return seen


def test_promoting_the_standby_mid_run_loses_no_job_and_no_outbox_event(
        cluster: tuple[ChaosStack, Results], request: pytest.FixtureRequest) -> None:
    """kill -9 of the primary and promotion of the standby during a load: 0 jobs lost,
    0 completed twice, 0 stuck, 0 outbox events unpublished, the slot not lost."""
    stack, results = cluster
    marks = [("start", time.monotonic())]
    tenant, key = new_tenant(stack.db, "failover")
    load = Load(stack.api_url, key, "failover", JOBS, LOAD_SECONDS).start()
    wait_for(lambda: len(load.accepted) >= JOBS // 3, timeout=300,
             what="a third of the jobs accepted before the failover")
    marks.append(("third accepted", time.monotonic()))
    wait_for(stack.synced_slot, timeout=60,
             what="the standby to hold a synchronised copy of the relay's slot")
    marks.append(("slot synced", time.monotonic()))
    killed_at = datetime.now(UTC)
    stack.fail_over()
    first = wait_for(lambda: _completed_after(stack.db, tenant, killed_at), timeout=180,
                     what="a job completed after the failover")
    recovery = (first - killed_at).total_seconds()
    marks.append(("first completion", time.monotonic()))
    load.join(timeout=600)
    marks.append(("load joined", time.monotonic()))

    last: dict[str, Any] = {}

    def drained() -> bool:
        rows = rows_of(stack.db, tenant)
        last["statuses"] = Counter(r["status"] for r in rows)
        last["waiting"] = [r["id"] for r in rows if r["status"] not in SETTLED][:5]
        if len(rows) < JOBS or any(r["status"] not in SETTLED for r in rows):
            return False
        results.poll()
        last["unpublished"] = sum(1 for r in rows if r["status"] != "awaiting_review"
                                  and r["id"] not in results.by_job)
        if last["unpublished"]:
            return False
        last["lagging"] = lagging_partitions(stack.bootstrap)
        return not last["lagging"]

    try:
        wait_for(drained, timeout=600 if FULL else 150, what="the backlog to drain")
    except AssertionError:
        raise AssertionError(f"not drained: {last}") from None
    marks.append(("drained", time.monotonic()))
    rows = {r["id"]: r for r in rows_of(stack.db, tenant)}
    accepted = set(load.accepted.values())
    with psycopg.connect(stack.db) as conn:
        outbox = {str(r[0]) for r in conn.execute("SELECT id FROM outbox").fetchall()}
        in_recovery = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    published = _published_ids(stack.bootstrap)
    unpublished = outbox - set(published)
    duplicates = sum(n - 1 for i, n in published.items() if i in outbox and n > 1)
    lost = len(accepted - set(rows))
    twice = sum(1 for r in rows.values() if r["completions"] > 1)
    stuck = sum(1 for r in rows.values() if r["status"] not in SETTLED)
    relay_log = (stack.home / "logs" / "relay.log").read_text(errors="replace")
    line = (f"postgres failover ({'full' if FULL else 'reduced'}): {JOBS} jobs, lost {lost}, "
            f"completed twice {twice}, stuck {stuck}; outbox events {len(outbox)}, "
            f"unpublished {len(unpublished)}, published more than once {duplicates}; "
            f"first completion {recovery:.2f} s after the kill; "
            f"{dict(Counter(r['status'] for r in rows.values()))}; "
            + ", ".join(f"{name} +{at - marks[0][1]:.0f} s" for name, at in marks[1:]))
    print(line)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    assert in_recovery == (False,)  # the address reaches the promoted standby
    assert lost == 0
    assert set(rows) == accepted
    assert twice == 0
    assert stuck == 0
    assert unpublished == set()
    assert "is gone from this server" not in relay_log  # resumed from the synced slot
    dead = [n for n, s in stack.services.items() if s.pid and not processes.is_alive(s.pid)]
    assert dead == [], f"{dead} stopped running"
