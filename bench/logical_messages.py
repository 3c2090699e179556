"""Outbox rows against transactional logical-decoding messages (issue 21): PostgreSQL's work
per event for each way of handing job events to the relay.

- ``rows``: today's outbox. Each transaction COPYs its events into ``outbox`` (heap tuple,
  primary-key entry), logical decoding streams the inserts (pgoutput, publication on
  ``outbox``), and the relay's prune later deletes the rows (a second WAL record per row,
  decoded and filtered out again) and autovacuum reclaims them (run here as ``VACUUM``).
- ``messages``: ``pg_logical_emit_message(true, prefix, content)`` in the same transaction:
  WAL only, streamed by pgoutput with ``messages 'true'``, nothing to delete or vacuum.

Both are decoded through a real pgoutput slot (``pg_logical_slot_get_binary_changes``, the
same output plugin and decoding the relay's walsender runs), so the figure is the whole of
PostgreSQL's part: write, decode, prune, vacuum. The events are the same Avro-ready JSON the
e2e scenario writes, in transactions of ``PER_TX`` (a claim/finish group commit's size).
The relay and Kafka are not part of it: their work per event is the same for both."""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg

from bench.common import Log, copy_outbox, outbox_rows, ratio, rounded
from bench.procs import Sampler
from bench.report import result
from bench.rig import Rig

__all__ = ["logical_messages"]

PER_TX = 20
PREFIX = "calmq.outbox"
SLOT_OPTIONS = ("'proto_version', '1', 'publication_names', 'bench_ab', "
                "'messages', 'true'")


def _drain_slot(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """Consume the slot to its end; (insert records, message records) seen."""
    inserts = messages = 0
    while True:
        rows = conn.execute(
            f"SELECT get_byte(data, 0) FROM pg_logical_slot_get_binary_changes("
            f"'bench_ab', NULL, 20000, {SLOT_OPTIONS})").fetchall()
        if not rows:
            return inserts, messages
        inserts += sum(1 for (b,) in rows if b == ord("I"))
        messages += sum(1 for (b,) in rows if b == ord("M"))


def _variant(rig: Rig, sampler: Sampler, name: str, rows: list[tuple[Any, ...]],
             log: Log) -> dict[str, Any]:
    log(f"  {name}: {len(rows)} events in transactions of {PER_TX}")
    # The same columns the outbox row has, as the message's content (built before the clock
    # starts, as the rows are).
    contents = [json.dumps({"id": r[0], "aggregatetype": r[1], "aggregateid": r[2],
                            "type": r[3], "payload": json.loads(r[4]), "headers": {}})
                for r in rows]
    with psycopg.connect(rig.database_url) as conn, \
            psycopg.connect(rig.database_url, autocommit=True) as reader:
        lsn0 = reader.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
        phase = sampler.phase(rig.infra_pids())
        t0 = time.perf_counter()
        for i in range(0, len(rows), PER_TX):
            chunk = rows[i:i + PER_TX]
            with conn.transaction():
                if name == "rows":
                    copy_outbox(conn, chunk)
                else:  # one statement per transaction, as the COPY is
                    conn.execute(
                        "SELECT pg_logical_emit_message(true, %s, c) FROM unnest(%s::text[]) c",
                        (PREFIX, contents[i:i + PER_TX]))
        write_s = time.perf_counter() - t0
        inserts, messages = _drain_slot(reader)
        if name == "rows":
            # The relay's prune (relay.sql relay_prune_published, in batches of 5,000) and
            # the vacuum autovacuum would run; their deletes are decoded (and filtered) too.
            while reader.execute(
                    "DELETE FROM outbox WHERE (txid, seq) IN (SELECT txid, seq FROM outbox "
                    "ORDER BY txid, seq LIMIT 5000)").rowcount:
                pass
            reader.execute("VACUUM outbox")
            _drain_slot(reader)
        sampler.end(phase)
        wal = int(reader.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)",
                                 (lsn0,)).fetchone()[0])  # type: ignore[index]
    seen = inserts if name == "rows" else messages
    if seen != len(rows):
        raise RuntimeError(f"{name}: the slot streamed {seen} of {len(rows)} events")
    pg = phase.cpu.get("postgres", 0.0)
    return {"pg_cpu_ms_per_event": rounded(pg * 1000 / len(rows), 4),
            "write_events_per_s": rounded(len(rows) / max(write_s, 1e-6)),
            "wal_bytes_per_event": rounded(wal / len(rows)), "events": len(rows)}


def logical_messages(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    with Rig(log=log) as rig:
        with psycopg.connect(rig.database_url, autocommit=True) as conn:
            conn.execute("CREATE PUBLICATION bench_ab FOR TABLE outbox WITH (publish = 'insert')")
            conn.execute("SELECT pg_create_logical_replication_slot('bench_ab', 'pgoutput')")
        rows = outbox_rows(size)
        # Once each first, unmeasured, so neither pays for a cold cache; then measured.
        _variant(rig, sampler, "rows", rows[: size // 10], lambda _m: None)
        _variant(rig, sampler, "messages", rows[: size // 10], lambda _m: None)
        outbox = _variant(rig, sampler, "rows", rows, log)
        messages = _variant(rig, sampler, "messages", rows, log)
        versions = rig.versions
    return result("logical_messages", size, messages, {"outbox_rows": outbox},
                  {"pg_cpu_per_event_vs_outbox_rows": ratio(
                      messages["pg_cpu_ms_per_event"], outbox["pg_cpu_ms_per_event"])},
                  versions)
