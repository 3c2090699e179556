"""The CDC relay on the real PostgreSQL and Kafka: completeness, order, filtering, DLQ,
catch-up, SIGTERM, housekeeping and `--drop-slot`.

Every test runs its own relay process on a database of its own (see tests/support/relay.py).
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import psycopg
import pytest

from calmq import topics
from calmq.kafka import create_topics
from calmq.relay import pgoutput
from calmq.tooling.devstack import StackState
from calmq.tooling.devstack.processes import free_port
from tests.support.relay import (
    INSERT,
    ROOT,
    RelayDb,
    RelayProcess,
    TopicReader,
    Written,
    job_order_violations,
    new_route,
    outbox_args,
    relay_db,
    relay_env,
    write_concurrently,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

StartRelay = Callable[..., RelayProcess]


@pytest.fixture
def db(stack: StackState) -> Iterator[RelayDb]:
    yield from relay_db(stack.env["CALMQ_DATABASE_URL"])


@pytest.fixture
def start_relay(stack: StackState, db: RelayDb) -> Iterator[StartRelay]:
    started: list[RelayProcess] = []

    def start(*args: str, wait: bool = True, **settings: str) -> RelayProcess:
        proc = RelayProcess(relay_env(stack.env, db, **settings), list(args)).start()
        started.append(proc)
        if wait:
            proc.wait_streaming()
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def route(stack: StackState) -> str:
    return new_route(stack.env["CALMQ_KAFKA_BOOTSTRAP"])


def _reader(stack: StackState, topic: str) -> TopicReader:
    return TopicReader(stack.env["CALMQ_KAFKA_BOOTSTRAP"], topic)


def _insert(db: RelayDb, route: str, job: str, seq: int = 0) -> str:
    event_id, args = outbox_args(route, job, seq)
    with db.connect() as conn:
        conn.execute(INSERT, args)
    return event_id


def test_concurrent_writers_arrive_complete_once_and_in_job_order(
    stack: StackState, db: RelayDb, route: str, start_relay: StartRelay
) -> None:
    """10,000 events from 20 concurrent writers all reach Kafka once, each job's in order."""
    start_relay()
    written = Written()
    write_concurrently(db.url, route, writers=20, jobs_per_writer=5, events_per_job=100,
                       written=written)
    assert len(written.events) == 10_000
    reader = _reader(stack, topics.topic_for_route(route))
    try:
        reader.wait_ids(set(written.events), timeout=90)
        counts = Counter(reader.ids())
        assert [i for i, n in counts.items() if n > 1] == []
        assert job_order_violations(reader.records, written) == []
        sample = reader.records[0]
        assert set(sample.headers) >= {"id", "eventType", "traceparent"}
        assert sample.headers["eventType"] == "job.requested"
    finally:
        reader.close()


def test_only_committed_outbox_rows_are_published(
    stack: StackState, db: RelayDb, route: str, start_relay: StartRelay
) -> None:
    """A rolled-back transaction publishes nothing; a mixed one publishes its outbox row only."""
    start_relay()
    job = str(uuid.uuid4())
    rolled_back_id, rolled_back = outbox_args(route, job, 0)
    mixed_id, mixed = outbox_args(route, job, 1)
    last_id, last = outbox_args(route, job, 2)
    with psycopg.connect(db.url) as conn:
        conn.execute(INSERT, rolled_back)
        conn.rollback()
        conn.execute("CREATE TABLE relay_test_notes (id serial PRIMARY KEY, note text)")
        conn.execute("INSERT INTO relay_test_notes (note) VALUES ('not an event')")
        conn.execute(INSERT, mixed)
        conn.execute("INSERT INTO relay_test_notes (note) VALUES ('still not an event')")
        conn.commit()
        conn.execute("INSERT INTO relay_test_notes (note) VALUES ('alone')")
        conn.commit()
        conn.execute(INSERT, last)
        conn.commit()
    reader = _reader(stack, topics.topic_for_route(route))
    try:
        reader.wait_ids({mixed_id, last_id})
        reader.poll()
        assert reader.ids() == [mixed_id, last_id]
        assert rolled_back_id not in reader.ids()
    finally:
        reader.close()


def test_payload_that_does_not_fit_goes_to_dlq_and_relay_goes_on(
    stack: StackState, db: RelayDb, route: str, start_relay: StartRelay
) -> None:
    """A row whose payload does not fit its Avro schema lands on calmq.dlq; the next is relayed."""
    relay = start_relay()
    bad_job, good_job = str(uuid.uuid4()), str(uuid.uuid4())
    bad_id, bad = outbox_args(route, bad_job, 0, payload={"event_id": str(uuid.uuid4()),
                                                          "job_id": bad_job, "attempt": "x"})
    with db.connect() as conn:
        conn.execute(INSERT, bad)
    good_id = _insert(db, route, good_job)
    dlq = _reader(stack, topics.DLQ)
    work = _reader(stack, topics.topic_for_route(route))
    try:
        work.wait_ids({good_id})
        wait_for(lambda: dlq.poll() and [r for r in dlq.records if r.key == bad_job],
                 timeout=30, what="the rejected row on calmq.dlq")
        [dead] = [r for r in dlq.records if r.key == bad_job]
        assert dead.headers["id"] == bad_id
        assert dead.headers["calmq-error-code"] == "schema_mismatch"
        assert relay.proc is not None
        assert relay.proc.poll() is None
        assert bad_id not in work.ids()
    finally:
        dlq.close()
        work.close()


def test_row_for_a_topic_that_does_not_exist_goes_to_dlq_and_relay_goes_on(
    stack: StackState, db: RelayDb, route: str, start_relay: StartRelay
) -> None:
    """A job routed to a pool without topics is dead-lettered with `unknown_topic`; the relay
    stays up and publishes the rows after it (it used to crash, and crash again on restart)."""
    relay = start_relay()
    lost_route = f"nopool{uuid.uuid4().hex[:8]}.bulk"  # never created
    lost_job, good_job = str(uuid.uuid4()), str(uuid.uuid4())
    lost_id = _insert(db, lost_route, lost_job)
    good_id = _insert(db, route, good_job)
    dlq = _reader(stack, topics.DLQ)
    work = _reader(stack, topics.topic_for_route(route))
    try:
        work.wait_ids({good_id})
        wait_for(lambda: dlq.poll() and [r for r in dlq.records if r.key == lost_job],
                 timeout=30, what="the unroutable row on calmq.dlq")
        [dead] = [r for r in dlq.records if r.key == lost_job]
        assert dead.headers["id"] == lost_id
        assert dead.headers["calmq-error-code"] == "unknown_topic"
        assert relay.proc is not None
        assert relay.proc.poll() is None
    finally:
        dlq.close()
        work.close()


def test_rows_committed_before_the_slot_existed_are_published(
    stack: StackState, db: RelayDb, route: str, start_relay: StartRelay
) -> None:
    """Outbox rows written before the relay first made its slot reach Kafka (catch-up)."""
    early = {_insert(db, route, str(uuid.uuid4())) for _ in range(3)}
    relay = start_relay()
    late = _insert(db, route, str(uuid.uuid4()))
    reader = _reader(stack, topics.topic_for_route(route))
    try:
        reader.wait_ids(early | {late})
        assert "3 rows published from its snapshot" in relay.log()
    finally:
        reader.close()


def _released(db: RelayDb) -> bool:
    row = db.slot_row()
    return row is not None and row[0] is False


def _unconfirmed_inserts(db: RelayDb) -> int:
    """Outbox inserts the slot would stream again (peeked, nothing consumed)."""
    with db.connect() as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL,"
            " 'proto_version', '1', 'publication_names', %s)",
            (db.slot, db.publication)).fetchall()
    return sum(isinstance(pgoutput.decode(bytes(r[0])), pgoutput.Insert) for r in rows)


def test_sigterm_flushes_confirms_and_exits(
    stack: StackState, db: RelayDb, route: str, start_relay: StartRelay
) -> None:
    """On SIGTERM the relay exits 0 with every published transaction confirmed to the slot."""
    relay = start_relay()
    ids = {_insert(db, route, str(uuid.uuid4()), i) for i in range(20)}
    reader = _reader(stack, topics.topic_for_route(route))
    try:
        reader.wait_ids(ids)
    finally:
        reader.close()
    assert relay.terminate() == 0
    wait_for(lambda: _released(db), timeout=10, what="the slot to be released")
    assert _unconfirmed_inserts(db) == 0
    # Nothing confirmed is streamed twice: a restarted relay starts after these rows.
    again = start_relay()
    marker = _insert(db, route, str(uuid.uuid4()))
    reader = _reader(stack, topics.topic_for_route(route))
    try:
        reader.wait_ids(ids | {marker})
        assert sorted(Counter(reader.ids()).values()) == [1] * 21
    finally:
        reader.close()
        again.stop()


def _metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_housekeeping_reports_lag_warns_and_deletes_published_rows(
    stack: StackState, db: RelayDb, route: str, start_relay: StartRelay
) -> None:
    """Lag gauges are exported, retained WAL over the setting is logged, old rows are deleted."""
    port = free_port()
    relay = start_relay("--metrics-port", str(port), outbox_retention_seconds="0",
                        relay_housekeeping_seconds="0.2", relay_wal_warn_bytes="1")
    ids = {_insert(db, route, str(uuid.uuid4())) for _ in range(5)}
    with psycopg.connect(db.url) as open_txn:
        # A row of a transaction still open is neither published nor deleted.
        pending_id, pending = outbox_args(route, str(uuid.uuid4()), 0)
        open_txn.execute(INSERT, pending)
        reader = _reader(stack, topics.topic_for_route(route))
        try:
            reader.wait_ids(ids)

            def published_rows_gone() -> bool:
                with db.connect() as conn:
                    return conn.execute("SELECT id FROM outbox").fetchall() == []

            wait_for(published_rows_gone, timeout=30, what="published rows to be deleted")
            open_txn.commit()
            reader.wait_ids({pending_id})
        finally:
            reader.close()
    wait_for(lambda: _metric(port, "calmq_relay_slot_lag_bytes") is not None, timeout=15,
             what="the slot lag metric")
    assert _metric(port, "calmq_relay_slot_lag_seconds") is not None
    assert _metric(port, "calmq_relay_slot_retained_wal_bytes") is not None
    assert "holds back" in relay.log()
    assert "relay_wal_warn_bytes" in relay.log()


def _drop_slot(db: RelayDb, stack: StackState) -> subprocess.CompletedProcess[str]:
    env = relay_env(stack.env, db)
    return subprocess.run([sys.executable, "-m", "calmq.cli", "relay", "--drop-slot"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)


def test_drop_slot_refuses_while_streaming_and_removes_it_after(
    stack: StackState, db: RelayDb, start_relay: StartRelay
) -> None:
    """`calmq relay --drop-slot` fails with slot_active under a live relay, then drops it."""
    relay = start_relay()
    busy = _drop_slot(db, stack)
    assert busy.returncode == 1
    assert "slot_active" in busy.stderr
    assert db.slot_row() is not None
    with db.connect() as conn:
        assert conn.execute("SELECT count(*) FROM relay_slots").fetchone() == (1,)
    assert relay.terminate() == 0
    wait_for(lambda: _released(db), timeout=10, what="the slot to be released")
    done = _drop_slot(db, stack)
    assert done.returncode == 0, done.stderr
    assert db.slot_row() is None
    with db.connect() as conn:
        assert conn.execute("SELECT count(*) FROM relay_slots").fetchone() == (0,)


def test_slot_made_by_another_relay_is_adopted_without_loss(
    stack: StackState, db: RelayDb, route: str, start_relay: StartRelay
) -> None:
    """A slot calmq did not make (as Debezium's connector leaves it) is streamed on, not remade."""
    with db.connect() as conn:
        conn.execute(f"CREATE PUBLICATION {db.publication} FOR TABLE outbox"
                     " WITH (publish = 'insert')")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (db.slot,))
    waiting = {_insert(db, route, str(uuid.uuid4()), i) for i in range(3)}
    relay = start_relay()
    reader = _reader(stack, topics.topic_for_route(route))
    try:
        reader.wait_ids(waiting)
        assert f"adopting existing slot {db.slot}" in relay.log()
        assert "created slot" not in relay.log()
    finally:
        reader.close()


def test_relay_resumes_by_itself_when_its_replication_connection_is_cut(
    stack: StackState, db: RelayDb, route: str, start_relay: StartRelay
) -> None:
    """After the server ends the relay's walsender, the relay reconnects and loses nothing."""
    relay = start_relay()
    before = {_insert(db, route, str(uuid.uuid4()), i) for i in range(5)}
    reader = _reader(stack, topics.topic_for_route(route))
    try:
        reader.wait_ids(before)
        with db.connect() as conn:
            conn.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                         " WHERE slot_name = %s", (db.slot,))
        after = {_insert(db, route, str(uuid.uuid4()), i) for i in range(5)}
        reader.wait_ids(before | after, timeout=60)
        assert "relay interrupted" in relay.log()
        assert relay.proc is not None
        assert relay.proc.poll() is None
    finally:
        reader.close()


def test_topic_replacement_setting_routes_like_debeziums_router(
    stack: StackState, db: RelayDb, route: str, start_relay: StartRelay
) -> None:
    """relay_topic_replacement puts a row on the topic its ${routedByValue} rule names."""
    prefix = f"outbox_{uuid.uuid4().hex[:8]}"
    topic = f"{prefix}.{route}.events"
    create_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], [topic], partitions=1)
    start_relay(relay_topic_replacement=prefix + ".${routedByValue}.events")
    event_id = _insert(db, route, str(uuid.uuid4()))
    reader = _reader(stack, topic)
    try:
        reader.wait_ids({event_id})
    finally:
        reader.close()
