"""The polling relay: pages the outbox by ``(txid, seq)`` below the snapshot's xmin.

Why xmin: ids (``seq``) are taken at insert time but become visible at commit time, so a
transaction that took seq 10 and commits after one that took seq 11 would be skipped by a
relay that pages by seq alone. Every transaction whose xid is below the current snapshot's
xmin has ended, so no row can appear behind the cursor later. The cursor is saved in the
database only after Kafka acknowledged the whole page: at-least-once, never a gap.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg
from psycopg.rows import dict_row

from calmq import sql
from calmq.relay.publisher import OutboxRow, Publisher

__all__ = ["PollingRelay"]

log = logging.getLogger(__name__)


class PollingRelay:
    def __init__(
        self,
        database_url: str,
        publisher: Publisher,
        *,
        name: str = "default",
        batch: int = 2000,
        idle_seconds: float = 0.005,
        retention_seconds: float = 600.0,
    ) -> None:
        self.database_url = database_url
        self.publisher = publisher
        self.name = name
        self.batch = batch
        self.idle_seconds = idle_seconds
        self.retention_seconds = retention_seconds
        self.published = 0
        self._q = sql.queries()

    def run(self, stop: threading.Event) -> None:
        """Relay until ``stop`` is set; the page in hand is flushed and saved first."""
        with psycopg.connect(self.database_url, autocommit=True, row_factory=dict_row) as conn:
            row = conn.execute(self._q["relay_cursor"], {"name": self.name}).fetchone()
            cursor = (row["txid"], row["seq"]) if row else ("0", 0)
            last_prune = time.monotonic()
            while not stop.is_set():
                moved = self.step(conn, cursor)
                if moved is None:
                    stop.wait(self.idle_seconds)
                    continue
                cursor = moved
                if time.monotonic() - last_prune > 5:
                    conn.execute(
                        self._q["prune_outbox"],
                        {"txid": cursor[0], "seq": cursor[1],
                         "retention_seconds": self.retention_seconds},
                    )
                    last_prune = time.monotonic()

    def step(
        self, conn: psycopg.Connection[dict], cursor: tuple[str, int]  # type: ignore[type-arg]
    ) -> tuple[str, int] | None:
        """Publish one page after ``cursor``; returns the new cursor, or None if idle."""
        rows = conn.execute(
            self._q["outbox_page"], {"txid": cursor[0], "seq": cursor[1], "limit": self.batch}
        ).fetchall()
        if not rows:
            return None
        for r in rows:
            self.publisher.send(
                OutboxRow(str(r["id"]), r["aggregatetype"], r["aggregateid"], r["type"],
                          r["payload"], r["headers"])
            )
        self.publisher.flush()
        last = rows[-1]
        new_cursor = (str(last["txid"]), int(last["seq"]))
        conn.execute(
            self._q["save_relay_cursor"],
            {"name": self.name, "txid": new_cursor[0], "seq": new_cursor[1]},
        )
        self.published += len(rows)
        return new_cursor
