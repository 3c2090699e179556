"""Helpers for the relay's tests: a database of its own, a relay process, writers, a reader.

Each test gets a separate database on the stack's PostgreSQL server (its own outbox,
publication and slot name) and a separate route, so that the stack's own relay never sees
its rows and its topic holds nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, TopicPartition
from psycopg.types.json import Jsonb

from calmq import events
from calmq.data.migrations import migrate
from calmq.kafka import create_topics
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def _swap_db(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


@dataclass
class RelayDb:
    """A fresh, migrated database; ``slot`` and ``publication`` are unique to it."""

    url: str
    name: str
    slot: str
    publication: str

    def connect(self, **kw: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True, **kw)

    def slot_row(self) -> tuple[Any, ...] | None:
        with self.connect() as conn:
            return conn.execute(
                "SELECT active, confirmed_flush_lsn::text FROM pg_replication_slots"
                " WHERE slot_name = %s", (self.slot,)).fetchone()


def make_db(admin_url: str) -> RelayDb:
    suffix = uuid.uuid4().hex[:10]
    name = f"relay_{suffix}"
    with psycopg.connect(_swap_db(admin_url, "postgres"), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = _swap_db(admin_url, name)
    migrate(url)
    return RelayDb(url, name, f"relay_test_{suffix}", f"relay_test_{suffix}")


def relay_db(admin_url: str) -> Iterator[RelayDb]:
    """A migrated database of its own for one relay test, dropped (with its slots) after."""
    made = make_db(admin_url)
    try:
        yield made
    finally:
        drop_db(admin_url, made)


def drop_db(admin_url: str, db: RelayDb) -> None:
    with psycopg.connect(_swap_db(admin_url, "postgres"), autocommit=True) as conn:
        # Slots pin the database; a relay killed by a test may still be releasing one.
        def slots_dropped() -> bool:
            slots = conn.execute(
                "SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s",
                (db.name,)).fetchall()
            for _, pid in slots:
                if pid is not None:
                    conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            try:
                for slot, _ in slots:
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            except psycopg.errors.ObjectInUse:
                return False  # its walsender is still exiting
            return True

        wait_for(slots_dropped, timeout=10, what=f"the slots of {db.name} to drop")
        conn.execute(f"DROP DATABASE IF EXISTS {db.name} WITH (FORCE)")


def new_route(bootstrap: str, partitions: int = 4) -> str:
    """A route (aggregatetype) of its own; its topic calmq.<route> is created empty."""
    route = f"relaytest_{uuid.uuid4().hex[:10]}"
    create_topics(bootstrap, [f"calmq.{route}"], partitions=partitions)
    return route


@dataclass
class RelayProcess:
    """``python -m calmq.cli relay`` against a test database, its output in a file."""

    env: dict[str, str]
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(suffix=".log")[1]))

    def start(self) -> RelayProcess:
        out = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "calmq.cli", "relay", *self.args],
            env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text("utf-8", "replace")

    def wait_streaming(self, timeout: float = 30) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"relay exited {self.proc.returncode}:\n{self.log()}")
            return "streaming slot" in self.log()
        wait_for(ready, timeout=timeout, what="the relay to stream")

    def terminate(self, timeout: float = 30) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def relay_env(stack_env: dict[str, str], db: RelayDb, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    env.update(stack_env)
    env.update({
        "CALMQ_DATABASE_URL": db.url,
        "CALMQ_RELAY_SLOT": db.slot,
        "CALMQ_RELAY_PUBLICATION": db.publication,
        "PYTHONUNBUFFERED": "1",
    })
    env.update({f"CALMQ_{k.upper()}": v for k, v in settings.items()})
    return env


def event_payload(job_id: str, seq: int) -> dict[str, Any]:
    """A valid job.requested payload; ``attempt`` carries the event's place in its job."""
    return events.requested({
        "id": job_id, "tenant_id": str(uuid.uuid4()), "workflow": "summarize",
        "workflow_version": 1, "step": "summarize", "attempt": seq, "priority": "bulk",
        "pool": "default",
    })


INSERT = ("INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)"
          " VALUES (%s, %s, %s, %s, %s, %s)")


def outbox_args(route: str, job_id: str, seq: int, *, event_type: str = "job.requested",
                payload: Any = None) -> tuple[str, tuple[Any, ...]]:
    body = event_payload(job_id, seq) if payload is None else payload
    event_id = body["event_id"] if isinstance(body, dict) and "event_id" in body \
        else str(uuid.uuid4())
    headers = {"traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"}
    return event_id, (event_id, route, job_id, event_type, Jsonb(body), Jsonb(headers))


@dataclass
class Written:
    """What the writers committed: event id -> (job, place in the job)."""

    events: dict[str, tuple[str, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def write_concurrently(url: str, route: str, *, writers: int, jobs_per_writer: int,
                       events_per_job: int, written: Written) -> None:
    """Each writer owns its jobs and commits one event of each of them per transaction."""
    errors: list[Exception] = []

    def writer() -> None:
        try:
            jobs = [str(uuid.uuid4()) for _ in range(jobs_per_writer)]
            with psycopg.connect(url) as conn:
                for seq in range(events_per_job):
                    rows = []
                    mine = {}
                    for job in jobs:
                        event_id, args = outbox_args(route, job, seq)
                        rows.append(args)
                        mine[event_id] = (job, seq)
                    with conn.cursor() as cur:
                        cur.executemany(INSERT, rows)
                    conn.commit()
                    with written.lock:
                        written.events.update(mine)
        except Exception as exc:  # noqa: BLE001 - re-raised in the calling thread below
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


@dataclass
class Record:
    partition: int
    offset: int
    key: str
    headers: dict[str, str]
    value: bytes


class TopicReader:
    """Reads a topic from its beginning; ``records`` grows with every ``poll``."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": f"relay-test-{uuid.uuid4().hex}",
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
        })
        meta = self.consumer.list_topics(topic, timeout=10).topics[topic]
        self.consumer.assign([TopicPartition(topic, p, 0) for p in meta.partitions])
        self.records: list[Record] = []

    def poll(self) -> list[Record]:
        new = []
        for msg in self.consumer.consume(num_messages=5000, timeout=0.2):
            if msg.error():
                continue
            # Topics such as calmq.dlq also hold what others wrote (fuzzed keys, stray bytes):
            # decoded leniently, so a reader never fails on a record that is not its own.
            headers = {str(k): v.decode(errors="replace") if isinstance(v, bytes)
                       else str(v or "")
                       for k, v in list(msg.headers() or [])}
            key = msg.key()
            new.append(Record(int(msg.partition() or 0), int(msg.offset() or 0),
                              key.decode(errors="replace") if isinstance(key, bytes)
                              else str(key or ""),
                              headers, bytes(msg.value() or b"")))
        self.records.extend(new)
        return new

    def ids(self) -> list[str]:
        return [r.headers["id"] for r in self.records]

    def wait_ids(self, expected: set[str], timeout: float = 60) -> None:
        def arrived() -> bool:
            self.poll()
            return expected <= set(self.ids())
        try:
            wait_for(arrived, timeout=timeout, what=f"{len(expected)} events on {self.topic}")
        except AssertionError:
            missing = expected - set(self.ids())
            raise AssertionError(f"{len(missing)} of {len(expected)} events missing on "
                                 f"{self.topic}, e.g. {sorted(missing)[:3]}") from None

    def close(self) -> None:
        self.consumer.close()


def job_order_violations(records: list[Record], written: Written) -> list[str]:
    """Jobs whose events (first delivery of each) are not in the order they were written."""
    seen: set[str] = set()
    last: dict[str, int] = {}
    bad = []
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        event_id = r.headers["id"]
        if event_id in seen or event_id not in written.events:
            continue
        seen.add(event_id)
        job, seq = written.events[event_id]
        if r.key != job:
            bad.append(f"event {event_id} has key {r.key}, not its job {job}")
        if seq < last.get(job, -1):
            bad.append(f"job {job}: event {seq} after event {last[job]}")
        last[job] = max(seq, last.get(job, -1))
    return bad
