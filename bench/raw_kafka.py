"""Baseline: raw confluent-kafka produce and consume of the same Avro events, no database.

The ceiling for e2e: what the broker and the client library do on this machine with nothing
else on the path. Also the relay's baseline (produce only: ``drain`` and ``rate``).
Run: ``python -m bench.raw_kafka e2e|drain|rate --topic T --count N``; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, Message, Producer

from calmq import events
from calmq.codec import EventCodec, make_codec, registry_config
from calmq.kafka import Connection, connection_config, consumer_config, producer_config
from calmq.settings import Settings

__all__ = ["clients", "encoded_events", "main"]


def clients(bootstrap: str) -> tuple[Connection, EventCodec]:
    """The Kafka connection and codec of this process's CALMQ_ settings (security, registry
    credentials), as calmq's own services make them, for ``bootstrap``."""
    settings = Settings.load({"kafka_bootstrap": bootstrap})
    return (connection_config(settings),
            make_codec(settings.schema_registry_url, registry_config(settings)))


def encoded_events(count: int, registry_url: str | None = None) -> list[tuple[bytes, bytes]]:
    """``count`` job.requested events as (key, Avro value), like the relay produces them."""
    if registry_url is None:
        registry_url = os.environ.get("CALMQ_SCHEMA_REGISTRY_URL", "")
    codec = make_codec(registry_url)
    tenant = str(uuid.uuid4())
    out = []
    for _ in range(count):
        job_id = uuid.uuid4()
        event = events.requested({
            "id": job_id, "tenant_id": tenant, "workflow": "summarize", "workflow_version": 1,
            "step": "summarize", "attempt": 0, "priority": "bulk", "pool": "default"})
        out.append((str(job_id).encode(), codec.encode("job.requested", event)))
    return out


def _connected(bootstrap: str, topic: str) -> Producer:
    """A producer that has its connection and idempotent producer id already, like the relay's
    long-lived one: the first record of a cold client would otherwise pay for both."""
    producer = Producer(producer_config(clients(bootstrap)[0]))
    producer.produce(topic, value=b"warm-up", key=b"warm-up")
    producer.flush(30)
    return producer


def _produce_all(producer: Producer, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    for key, value in records:
        while True:
            try:
                producer.produce(topic, value=value, key=key,
                                 headers=[("eventType", b"job.requested")])
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    producer.flush(60)


def e2e(bootstrap: str, topic: str, count: int) -> dict[str, Any]:
    """Produce ``count`` events and consume them in another thread; jobs/s end to end."""
    records = encoded_events(count)
    connection, codec = clients(bootstrap)
    consumer = Consumer(consumer_config(connection, f"bench-raw-{uuid.uuid4()}"))
    consumer.subscribe([topic])
    ready = threading.Event()
    seen = 0
    done_at = 0.0

    def consume() -> None:
        nonlocal seen, done_at
        deadline = time.monotonic() + 120
        while seen < count and time.monotonic() < deadline:
            msgs: list[Message] = consumer.consume(1000, timeout=0.05)
            if consumer.assignment():
                ready.set()
            for m in msgs:
                if m.error() is None and m.key() != b"warm-up":
                    codec.decode(m.value() or b"")  # the worker decodes every event too
                    seen += 1
            if msgs:
                consumer.commit(asynchronous=True)
        done_at = time.time()

    thread = threading.Thread(target=consume)
    thread.start()
    producer = _connected(bootstrap, topic)
    ready.wait(30)
    started = time.time()
    _produce_all(producer, topic, records)
    thread.join()
    consumer.close()
    elapsed = done_at - started
    return {"jobs_per_s": round(seen / elapsed, 1), "count": seen, "elapsed_s": round(elapsed, 3)}


def drain(bootstrap: str, topic: str, count: int) -> dict[str, Any]:
    """Produce a backlog of ``count`` pre-encoded events as fast as acks come back."""
    records = encoded_events(count)
    producer = _connected(bootstrap, topic)
    t0 = time.perf_counter()
    _produce_all(producer, topic, records)
    elapsed = time.perf_counter() - t0
    return {"drain_events_per_s": round(count / elapsed, 1), "count": count,
            "elapsed_s": round(elapsed, 3)}


def rate(bootstrap: str, topic: str, count: int, per_second: float) -> dict[str, Any]:
    """Produce at a fixed rate; latency from produce() to the broker's ack, per event."""
    from bench.loadgen import percentile

    records = encoded_events(count)
    producer = _connected(bootstrap, topic)
    latencies: list[float] = []

    def acked(sent: float) -> Any:
        def report(err: Any, _msg: Message) -> None:
            if err is None:
                latencies.append((time.perf_counter() - sent) * 1000)
        return report

    t0 = time.perf_counter()
    batch = max(1, int(per_second / 200))  # the relay also sees ~5 ms worth per commit
    for i in range(0, count, batch):
        delay = t0 + i / per_second - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        now = time.perf_counter()
        for key, value in records[i:i + batch]:
            producer.produce(topic, value=value, key=key, on_delivery=acked(now))
        producer.poll(0)
    producer.flush(60)
    return {"ack_p50_ms": round(percentile(latencies, 50), 2),
            "ack_p99_ms": round(percentile(latencies, 99), 2), "count": len(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.raw_kafka")
    parser.add_argument("mode", choices=["e2e", "drain", "rate"])
    parser.add_argument("--topic", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--rate", type=float, default=2000)
    args = parser.parse_args()
    bootstrap = os.environ["CALMQ_KAFKA_BOOTSTRAP"]
    if args.mode == "e2e":
        out = e2e(bootstrap, args.topic, args.count)
    elif args.mode == "drain":
        out = drain(bootstrap, args.topic, args.count)
    else:
        out = rate(bootstrap, args.topic, args.count, args.rate)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
