"""The polling relay (``--mode polling``) on the real PostgreSQL and Kafka."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from confluent_kafka import Producer
from psycopg.rows import dict_row

from calmq import topics
from calmq.codec import make_codec
from calmq.data.relay import OutboxPosition
from calmq.kafka import producer_config
from calmq.relay import PollingRelay, Publisher
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

pytestmark = pytest.mark.integration


@pytest.fixture
def db(stack: StackState) -> Iterator[RelayDb]:
    yield from relay_db(stack.env["CALMQ_DATABASE_URL"])


def test_interleaved_transactions_committing_out_of_id_order_are_both_published(
    stack: StackState, db: RelayDb
) -> None:
    """A row whose transaction commits after a later-numbered one is not skipped."""
    bootstrap = stack.env["CALMQ_KAFKA_BOOTSTRAP"]
    route = new_route(bootstrap)
    publisher = Publisher(Producer(producer_config(bootstrap)),
                          make_codec(stack.env.get("CALMQ_SCHEMA_REGISTRY_URL", "")))
    relay = PollingRelay(db.url, publisher, name="interleaved")
    job = str(uuid.uuid4())
    a1_id, a1 = outbox_args(route, job, 0)
    b_id, b = outbox_args(route, job, 1)
    a2_id, a2 = outbox_args(route, job, 2)
    reader = TopicReader(bootstrap, topics.topic_for_route(route))
    with psycopg.connect(db.url) as first, psycopg.connect(db.url) as second, \
            psycopg.connect(db.url, autocommit=True, row_factory=dict_row) as relay_conn:
        first.execute(INSERT, a1)   # first transaction: lower xid, seq n
        second.execute(INSERT, b)   # second transaction: higher xid, seq n+1
        first.execute(INSERT, a2)   # first again: seq n+2
        second.commit()             # the higher seq commits first
        # The first transaction is still open, so nothing is below the snapshot's xmin yet:
        # a relay paging by seq alone would publish b and move past a1 for ever.
        assert relay.step(relay_conn, OutboxPosition()) is None
        first.commit()
        cursor = relay.step(relay_conn, OutboxPosition())
        assert cursor is not None
        assert relay.step(relay_conn, cursor) is None
    try:
        reader.wait_ids({a1_id, a2_id, b_id})
        reader.poll()
        # Pages go by (txid, seq): the first transaction's rows, then the second's.
        assert reader.ids() == [a1_id, a2_id, b_id]
        with psycopg.connect(db.url) as conn:
            saved = conn.execute("SELECT txid::text, seq FROM relay_cursor"
                                 " WHERE name = 'interleaved'").fetchone()
        assert saved == (cursor.txid, cursor.seq)
    finally:
        reader.close()


def test_relay_mode_polling_from_the_command_line_publishes(
    stack: StackState, db: RelayDb
) -> None:
    """`calmq relay --mode polling` publishes outbox rows and makes no replication slot."""
    route = new_route(stack.env["CALMQ_KAFKA_BOOTSTRAP"])
    relay = RelayProcess(relay_env(stack.env, db), ["--mode", "polling"]).start()
    reader = TopicReader(stack.env["CALMQ_KAFKA_BOOTSTRAP"], topics.topic_for_route(route))
    try:
        event_id, args = outbox_args(route, str(uuid.uuid4()), 0)
        with db.connect() as conn:
            conn.execute(INSERT, args)
        reader.wait_ids({event_id})
        assert db.slot_row() is None
        assert relay.terminate() == 0
    finally:
        relay.stop()
        reader.close()


def test_polling_relay_resumes_from_its_cursor_after_losing_its_connection(
    stack: StackState, db: RelayDb
) -> None:
    """The polling relay's connection terminated by the server: it reconnects and publishes on."""
    route = new_route(stack.env["CALMQ_KAFKA_BOOTSTRAP"])
    relay = RelayProcess(relay_env(stack.env, db), ["--mode", "polling"]).start()
    reader = TopicReader(stack.env["CALMQ_KAFKA_BOOTSTRAP"], topics.topic_for_route(route))
    try:
        first_id, first = outbox_args(route, str(uuid.uuid4()), 0)
        with db.connect() as conn:
            conn.execute(INSERT, first)
        reader.wait_ids({first_id})
        with db.connect() as conn:
            killed = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchone()
        assert killed is not None
        assert killed[0] >= 1
        second_id, second = outbox_args(route, str(uuid.uuid4()), 1)
        with db.connect() as conn:
            conn.execute(INSERT, second)
        reader.wait_ids({first_id, second_id})
        assert relay.proc is not None
        assert relay.proc.poll() is None  # still running: it reconnected instead of dying
        assert "polling relay interrupted" in relay.log()
        assert relay.terminate() == 0
    finally:
        relay.stop()
        reader.close()
