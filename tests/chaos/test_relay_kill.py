"""kill -9 of the CDC relay in the middle of a 10,000-event run loses nothing.

A second logical slot on the same publication (peeked, never consumed) tells the test each
event's transaction end LSN, so it can check that the only events published twice belong to
transactions the killed relay had not confirmed.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator

import psycopg
import pytest

from calmq import topics
from calmq.relay import pgoutput
from calmq.tooling.devstack import StackState
from tests.support.relay import (
    RelayDb,
    RelayProcess,
    TopicReader,
    Written,
    job_order_violations,
    new_route,
    relay_db,
    relay_env,
    write_concurrently,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.chaos


@pytest.fixture
def db(stack: StackState) -> Iterator[RelayDb]:
    yield from relay_db(stack.env["CALMQ_DATABASE_URL"])


def _pg_lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def _end_lsn_by_event(db: RelayDb, witness: str) -> dict[str, int]:
    """Event id -> end LSN of its transaction, from the witness slot (nothing consumed)."""
    out: dict[str, int] = {}
    relations: dict[int, pgoutput.Relation] = {}
    ids: list[str] = []
    with db.connect() as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL,"
            " 'proto_version', '1', 'publication_names', %s)", (witness, db.publication))
        for (data,) in rows:
            message = pgoutput.decode(bytes(data))
            if isinstance(message, pgoutput.Relation):
                relations[message.relation_id] = message
            elif isinstance(message, pgoutput.Insert):
                row = pgoutput.row_as_dict(relations[message.relation_id], message)
                ids.append(str(row["id"]))
            elif isinstance(message, pgoutput.Commit):
                out.update(dict.fromkeys(ids, message.end_lsn))
                ids = []
    return out


def test_kill_9_mid_run_loses_nothing_and_repeats_only_unconfirmed(
    stack: StackState, db: RelayDb
) -> None:
    """After kill -9 and a restart all 10,000 events are on Kafka; repeats are unconfirmed only."""
    bootstrap = stack.env["CALMQ_KAFKA_BOOTSTRAP"]
    route = new_route(bootstrap)
    env = relay_env(stack.env, db)
    first = RelayProcess(env).start()
    second: RelayProcess | None = None
    witness = f"{db.slot}_witness"
    reader = TopicReader(bootstrap, topics.topic_for_route(route))
    try:
        first.wait_streaming()
        with db.connect() as conn:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (witness,))
        written = Written()
        writers = threading.Thread(target=write_concurrently, args=(db.url, route), kwargs={
            "writers": 20, "jobs_per_writer": 5, "events_per_job": 100, "written": written})
        writers.start()
        kill_after = random.randint(500, 6000)
        wait_for(lambda: reader.poll() is not None and len(reader.records) >= kill_after,
                 timeout=90, what=f"{kill_after} events before the kill")
        first.kill9()

        def released() -> str | None:
            row = db.slot_row()
            return row[1] if row is not None and row[0] is False else None

        confirmed_at_kill = _pg_lsn(wait_for(released, timeout=15, what="the slot released"))
        writers.join(120)
        assert len(written.events) == 10_000
        second = RelayProcess(env).start()
        reader.wait_ids(set(written.events), timeout=90)
        assert job_order_violations(reader.records, written) == []
        end_lsn = _end_lsn_by_event(db, witness)
        repeated = [i for i, n in Counter(reader.ids()).items() if n > 1]
        confirmed_repeats = [i for i in repeated if end_lsn[i] <= confirmed_at_kill]
        assert confirmed_repeats == [], f"{len(confirmed_repeats)} confirmed events published twice"
        second.wait_streaming()
        assert second.terminate() == 0
    finally:
        reader.close()
        first.stop()
        if second is not None:
            second.stop()
        with psycopg.connect(db.url, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                         " WHERE slot_name = %s", (witness,))
