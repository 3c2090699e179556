"""The database-side slot metrics against the real PostgreSQL: an abandoned replication slot
(no relay streams from it) shows its retained WAL growing and reads inactive, on the API's
/metrics, which keeps serving them while no relay runs."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from calmq.data import Database
from calmq.data.observability import replication_slots
from calmq.settings import Settings
from calmq.tooling.devstack import StackState
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

RETAINED = "calmq_replication_slot_retained_wal_bytes"
ACTIVE = "calmq_replication_slot_active"


def _write_wal(url: str, size: int) -> None:
    """Write ``size`` bytes of WAL without touching a table: a transactional logical message,
    whose commit flushes it, so pg_current_wal_lsn() (the written position) moves past it."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_logical_emit_message(true, 'calmq-test', repeat('x', %s))",
                     (size,))


@pytest.fixture
def abandoned_slot(stack: StackState) -> Iterator[str]:
    """A logical slot that no process streams from, dropped after the test (an abandoned
    slot keeps WAL for every later test otherwise)."""
    url = stack.env["CALMQ_DATABASE_URL"]
    name = f"calmq_test_abandoned_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
    try:
        yield name
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                         " WHERE slot_name = %s", (name,))


def _api_samples(stack: StackState) -> dict[tuple[str, str], float]:
    """(metric, slot) -> value of the slot metrics on the API's /metrics."""
    url = next(p.address for p in stack.parts if p.name == "api") + "/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, s.labels["slot"]): float(s.value)
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in (RETAINED, ACTIVE)}


async def test_the_query_reports_an_abandoned_slot_retaining_wal(
    stack: StackState, db: Database, abandoned_slot: str,
) -> None:
    """replication_slots() lists the abandoned slot as inactive with > 0 retained bytes, and
    its retained WAL grows as WAL is written."""
    _write_wal(stack.env["CALMQ_DATABASE_URL"], 64 * 1024)
    first = {s.slot: s for s in await replication_slots(db)}[abandoned_slot]
    assert first.active is False
    assert first.retained_bytes > 0
    _write_wal(stack.env["CALMQ_DATABASE_URL"], 64 * 1024)
    second = {s.slot: s for s in await replication_slots(db)}[abandoned_slot]
    assert second.retained_bytes >= first.retained_bytes + 64 * 1024


def test_the_api_exports_the_abandoned_slot_and_the_live_relay_slot(
    stack: StackState, abandoned_slot: str,
) -> None:
    """The API's /metrics shows the abandoned slot with retained WAL > 0 and active 0, and the
    stack's running relay's slot with active 1: the values come from PostgreSQL, not a relay."""
    _write_wal(stack.env["CALMQ_DATABASE_URL"], 64 * 1024)
    relay_slot = Settings.load(environ=stack.env).relay_slot

    def exported() -> dict[tuple[str, str], float] | None:
        samples = _api_samples(stack)
        return samples if samples.get((RETAINED, abandoned_slot), 0) > 0 else None

    samples = wait_for(exported, timeout=30, what="the API to export the abandoned slot")
    assert samples[(ACTIVE, abandoned_slot)] == 0
    assert samples[(ACTIVE, relay_slot)] == 1
    assert samples[(RETAINED, relay_slot)] >= 0


def test_a_dropped_slot_leaves_the_api_metrics(stack: StackState) -> None:
    """Once a slot is dropped its series go from /metrics (it retains nothing any more),
    rather than staying at their last value."""
    url = stack.env["CALMQ_DATABASE_URL"]
    name = f"calmq_test_dropped_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
        try:
            wait_for(lambda: (ACTIVE, name) in _api_samples(stack), timeout=30,
                     what="the API to export the new slot")
        finally:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    wait_for(lambda: not {(RETAINED, name), (ACTIVE, name)} & _api_samples(stack).keys(),
             timeout=30, what="the dropped slot's series to go")
