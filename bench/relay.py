"""The relay scenario: an outbox backlog drained to Kafka, and commit-to-ack latency at a
steady rate, against producing the same Avro events straight to the broker (raw_kafka)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
from confluent_kafka import Consumer, TopicPartition

from bench.common import (
    PY,
    RELAY_TOPIC,
    Log,
    copy_outbox,
    create_topic,
    oneshot,
    outbox_rows,
    process_costs,
    ratio,
    relay_mode,
    rounded,
    wait,
)
from bench.loadgen import percentile
from bench.procs import Sampler
from bench.report import result
from bench.rig import Rig

RELAY_RATE = 2000.0
RELAY_SECONDS = 5.0


class _AppendTimes:
    """Consumes a LogAppendTime topic: broker append time (≈ the ack) per event id header."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = Consumer({"bootstrap.servers": bootstrap,
                                  "group.id": f"bench-{uuid.uuid4()}",
                                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
        # A topic created a moment ago may not show its partitions in metadata yet.
        deadline = time.monotonic() + 30
        partitions: list[int] = []
        while not partitions and time.monotonic() < deadline:
            meta = self.consumer.list_topics(topic, timeout=10).topics.get(topic)
            partitions = list(meta.partitions) if meta is not None else []
            if not partitions:
                time.sleep(0.1)
        self.consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        self.times: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for msg in self.consumer.consume(2000, timeout=0.05):
                if msg.error() is not None:
                    continue
                raw_id = dict(msg.headers() or []).get("id") or b""
                event_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
                self.times[event_id] = msg.timestamp()[1]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.consumer.close()


def relay(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    with Rig(log=log) as rig:
        create_topic(rig.bootstrap, RELAY_TOPIC, 8, {"message.timestamp.type": "LogAppendTime"})
        # A CDC relay sees only what is written after its replication slot exists: run it
        # once so the slot is there, stop it, then build the backlog behind it.
        rig.calmq("relay")
        wait(lambda: int(rig.query("SELECT count(*) FROM pg_replication_slots")[0][0])
              if relay_mode() == "cdc" else 1, 1, 30, "replication slot", log)
        rig.stop("relay")
        log(f"  calmq: a backlog of {size} outbox rows, then the relay starts")
        with psycopg.connect(rig.database_url) as conn:
            rows = outbox_rows(size)
            for i in range(0, size, 1000):
                with conn.transaction():
                    copy_outbox(conn, rows[i:i + 1000])
        times = _AppendTimes(rig.bootstrap, RELAY_TOPIC)
        phase = sampler.phase(rig.infra_pids())
        proc = rig.calmq("relay")
        phase.pids["relay"] = proc.pid
        wait(lambda: len(times.times), size, 60 + size / 200, "relay backlog", log)
        stamps = sorted(times.times.values())
        drain = (len(stamps) - 1) / max((stamps[-1] - stamps[0]) / 1000, 1e-3) if stamps else 0.0
        sampler.end(phase)
        costs = process_costs(phase, ["relay"], len(stamps))

        total = int(RELAY_RATE * RELAY_SECONDS)
        log(f"  calmq: commit→ack at {RELAY_RATE:.0f} events/s for {RELAY_SECONDS:.0f} s")
        commit_ms: dict[str, float] = {}
        per_tx = max(1, int(RELAY_RATE / 200))
        rows = outbox_rows(total)
        with psycopg.connect(rig.database_url) as conn:
            t0 = time.perf_counter()
            for i in range(0, total, per_tx):
                delay = t0 + i / RELAY_RATE - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                chunk = rows[i:i + per_tx]
                with conn.transaction():
                    copy_outbox(conn, chunk)
                now_ms = time.time() * 1000
                for r in chunk:
                    commit_ms[r[0]] = now_ms
        wait(lambda: sum(1 for k in commit_ms if k in times.times), total, 60, "relay acks", log)
        times.close()
        lat = [times.times[k] - v for k, v in commit_ms.items() if k in times.times]
        figures = {"drain_events_per_s": rounded(drain),
                   "ack_p50_ms": rounded(percentile(lat, 50), 2),
                   "ack_p99_ms": rounded(percentile(lat, 99), 2), "backlog": size,
                   "acked_at_rate": len(lat), **costs}
        rig.stop("relay")

        create_topic(rig.bootstrap, "bench.raw.relay", 8)
        log("  baseline raw_kafka: the same Avro events produced straight to the broker")
        phase = sampler.phase(rig.infra_pids())
        raw, cpu, rss = oneshot(rig, "raw_kafka_drain", [PY, "-m", "bench.raw_kafka", "drain",
                                                          "--topic", "bench.raw.relay",
                                                          "--count", str(size)])
        sampler.end(phase)
        paced = oneshot(rig, "raw_kafka_rate", [PY, "-m", "bench.raw_kafka", "rate",
                                                 "--topic", "bench.raw.relay",
                                                 "--count", str(total),
                                                 "--rate", str(RELAY_RATE)])[0]
        baseline = {"drain_events_per_s": raw["drain_events_per_s"],
                    "ack_p50_ms": paced["ack_p50_ms"], "ack_p99_ms": paced["ack_p99_ms"],
                    "peak_rss_mb": rounded(rss),
                    "cpu_s_per_1000_jobs": rounded(
                        (cpu + sum(phase.cpu.values())) * 1000 / size, 3),
                    "cpu_s_per_1000_jobs_own": rounded(cpu * 1000 / size, 3)}
        versions = rig.versions
    return result("relay", size, figures, {"raw_kafka": baseline},
                  {"drain_events_per_s_vs_raw_kafka": ratio(figures["drain_events_per_s"],
                                                             baseline["drain_events_per_s"])},
                  versions, extra_versions={"relay_mode": relay_mode()})
