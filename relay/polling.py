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

from calmq.data import relay as bookkeeping
from calmq.data.relay import OutboxPosition, SyncConnection
from calmq.errors import InfrastructureError
from calmq.relay.publisher import Publisher
from calmq.retrying import Backoff, Reconnect

__all__ = ["PollingRelay"]

log = logging.getLogger(__name__)

# The same pause as the CDC relay's: one relay per database, but restarted with its database.
_RESUME = Backoff(initial=1.0, maximum=30.0)


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

    def run(self, stop: threading.Event) -> None:
        """Relay until ``stop`` is set; the page in hand is flushed and saved first.

        A lost connection to PostgreSQL (or a page Kafka refused) starts again from the saved
        cursor after a jittered pause: the unsaved page is sent again, never skipped.
        """
        reconnect = Reconnect("polling relay interrupted, resuming from its cursor", _RESUME)
        while not stop.is_set():
            try:
                self._run_once(stop)
                return
            except (psycopg.OperationalError, InfrastructureError) as exc:
                if stop.wait(reconnect.failed(exc)):
                    return

    def _run_once(self, stop: threading.Event) -> None:
        with bookkeeping.connect(self.database_url) as conn:
            cursor = bookkeeping.load_position(conn, self.name)
            last_prune = time.monotonic()
            while not stop.is_set():
                moved = self.step(conn, cursor)
                if moved is None:
                    stop.wait(self.idle_seconds)
                    continue
                cursor = moved
                if time.monotonic() - last_prune > 5:
                    bookkeeping.prune_outbox(conn, cursor, self.retention_seconds)
                    last_prune = time.monotonic()

    def step(self, conn: SyncConnection, cursor: OutboxPosition) -> OutboxPosition | None:
        """Publish one page after ``cursor``; returns the new cursor, or None if idle."""
        rows, moved = bookkeeping.outbox_page(conn, cursor, self.batch)
        if not rows:
            return None
        for row in rows:
            self.publisher.send(row)
        self.publisher.flush()
        bookkeeping.save_position(conn, self.name, moved)
        self.published += len(rows)
        return moved
