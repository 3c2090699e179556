"""The CDC relay: outbox inserts from PostgreSQL logical replication (pgoutput v1) to Kafka.

A publication on the outbox table (inserts only) and a logical replication slot with the
built-in ``pgoutput`` plugin, read over the streaming replication protocol with psycopg2's
``LogicalReplicationConnection``. Transactions arrive in commit order; every row is
produced at once (idempotent producer, key = job id, so one job's events keep their order)
and a transaction's **end** LSN is confirmed to the server only when Kafka acknowledged
every record of it and of every transaction before it (:class:`PendingTransactions`). After
a crash the slot streams again from the last confirmed transaction: duplicates of
unconfirmed transactions, never a gap.

Two details keep that promise:

- A slot streams only what commits after it exists. When the relay creates its slot it
  publishes, from the snapshot the slot exports, the rows already committed above the
  polling relay's cursor, then records the catch-up in ``relay_slots``. A slot found without
  that record (the relay died during catch-up) is dropped and made again.
- psycopg2 moves its flush position to the server's WAL end on a keepalive whenever the
  last confirmed LSN is at or past the start of the last message received. A transaction
  that began before the previous one committed has changes *below* that commit's end, so a
  keepalive arriving in the middle of it would confirm it unacknowledged. The walsender
  sends keepalives inside a transaction only for ``wal_sender_timeout``, so the replication
  connection runs with ``wal_sender_timeout=0``; between transactions the advance is safe
  (everything received is confirmed). A dead relay is still seen at once: its socket closes.

Housekeeping runs on its own thread and connection: slot lag metrics, a warning when the
slot holds back more WAL than a setting, and deletion of published outbox rows after the
retention (the WAL already holds them, so deleting a row never loses its event).
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any

import psycopg
import psycopg2
import psycopg2.extensions
import psycopg2.extras
from prometheus_client import Counter, Gauge

from calmq.data import relay as bookkeeping
from calmq.data.relay import OUTBOX_TABLE, Horizon, SlotState, SyncConnection
from calmq.errors import ConfigError, InfrastructureError
from calmq.relay import pgoutput
from calmq.relay.publisher import OutboxRow, Publisher
from calmq.retrying import Backoff, Reconnect

__all__ = ["CdcRelay", "PendingTransactions", "drop_slot", "lsn_text"]

log = logging.getLogger(__name__)

# Pauses before streaming again after a lost connection: 1 s doubling to 30 s, as before.
_RESUME = Backoff(initial=1.0, maximum=30.0)


def lsn_text(lsn: int) -> str:
    """An LSN as PostgreSQL prints it: ``16/B374D848``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


@dataclass(eq=False)
class _Txn:
    xid: int
    commit_time: datetime
    outstanding: int = 0
    records: int = 0
    end_lsn: int | None = None  # set by the Commit message


@dataclass(frozen=True)
class Confirmable:
    """A finished prefix: its newest transaction's end LSN and what it carried."""

    end_lsn: int
    commit_time: datetime
    transactions: int
    records: int


@dataclass
class PendingTransactions:
    """Transactions not yet confirmed, in commit order, and how far the slot may be confirmed.

    ``confirmable`` returns the end LSN of the newest transaction such that it and every
    transaction before it are committed and fully acknowledged; a transaction still being
    received, or with a record not yet acked, holds back everything after it.
    """

    _txns: deque[_Txn] = field(default_factory=deque)
    in_flight: int = 0  # records produced and not yet acknowledged

    def begin(self, xid: int, commit_time: datetime) -> _Txn:
        txn = _Txn(xid, commit_time)
        self._txns.append(txn)
        return txn

    def sent(self, txn: _Txn) -> Callable[[], None]:
        """Count one record of ``txn``; returns the callback for its ack."""
        txn.outstanding += 1
        txn.records += 1
        self.in_flight += 1

        def acked() -> None:
            txn.outstanding -= 1
            self.in_flight -= 1

        return acked

    def commit(self, txn: _Txn, end_lsn: int) -> None:
        txn.end_lsn = end_lsn

    def confirmable(self) -> Confirmable | None:
        """Pop the finished prefix of transactions; None if it is empty."""
        done = None
        count = records = 0
        txns = self._txns
        while txns and txns[0].end_lsn is not None and txns[0].outstanding == 0:
            done = txns.popleft()
            count += 1
            records += done.records
        if done is None or done.end_lsn is None:
            return None
        return Confirmable(done.end_lsn, done.commit_time, count, records)

    @property
    def pending(self) -> int:
        return len(self._txns)


@cache
def _metrics() -> dict[str, Any]:
    # Created on first use, not at import; the only label is the slot (bounded).
    return {
        "lag_bytes": Gauge("calmq_relay_slot_lag_bytes",
                           "WAL written since the slot's last confirmed transaction", ["slot"]),
        "retained_bytes": Gauge("calmq_relay_slot_retained_wal_bytes",
                                "WAL the server keeps for the slot", ["slot"]),
        "lag_seconds": Gauge("calmq_relay_slot_lag_seconds",
                             "Commit to confirmation of the newest confirmed transaction; "
                             "0 when nothing is pending", ["slot"]),
        "published": Counter("calmq_relay_published_total",
                             "Outbox rows acknowledged by Kafka (DLQ included)", ["slot"]),
        "pruned": Counter("calmq_relay_pruned_total",
                          "Published outbox rows deleted after the retention", ["slot"]),
        "lost": Counter("calmq_relay_slot_lost_total",
                        "Times the relay found its slot gone (a failover to a standby that "
                        "did not synchronise it) and re-published the outbox", ["slot"]),
    }


def _check_name(kind: str, name: str) -> str:
    if not name.replace("_", "").isalnum() or not name.islower() or len(name) > 63:
        raise ConfigError(
            f"{kind} name {name!r} must be lowercase letters, digits and underscores",
            code="bad_relay_name",
        )
    return name


def drop_slot(database_url: str, slot: str) -> bool:
    """Remove the relay's replication slot on purpose; False if it did not exist.

    Raises ConfigError(code='slot_active') while a relay streams from it.
    """
    with bookkeeping.connect(database_url) as conn:
        state = bookkeeping.slot_state(conn, slot)
        if state is not None and state.active:
            raise ConfigError(
                f"slot {slot} is in use by server process {state.active_pid}: stop the relay "
                "first", code="slot_active",
            )
        with conn.transaction():
            bookkeeping.forget_slot(conn, slot)
            if state is not None:
                bookkeeping.drop_slot(conn, slot)
    return state is not None


class CdcRelay:
    """Relays outbox inserts from a logical replication slot; ``run(stop)`` until stopped.

    Counters for a caller (a benchmark, a test): ``published`` (rows acked by Kafka),
    ``transactions`` (transactions confirmed), ``confirmed_lsn`` and ``publisher.rejected``.
    ``on_ack(row, commit_time)`` is called for every acked row if given.
    """

    def __init__(
        self,
        database_url: str,
        publisher: Publisher,
        *,
        slot: str = "calmq_outbox",
        publication: str = "calmq_outbox",
        cursor_name: str = "default",
        retention_seconds: float = 600.0,
        housekeeping_seconds: float = 5.0,
        prune_batch: int = 5000,
        wal_warn_bytes: int = 1 << 30,
        max_in_flight: int = 100_000,
        on_ack: Callable[[OutboxRow, datetime], None] | None = None,
    ) -> None:
        self.database_url = database_url
        self.publisher = publisher
        self.slot = _check_name("slot", slot)
        self.publication = _check_name("publication", publication)
        self.cursor_name = cursor_name
        self.retention_seconds = retention_seconds
        self.housekeeping_seconds = housekeeping_seconds
        self.prune_batch = prune_batch
        self.wal_warn_bytes = wal_warn_bytes
        self.max_in_flight = max_in_flight
        self.on_ack = on_ack
        self.published = 0
        self.transactions = 0
        self.pruned = 0
        self.confirmed_lsn = 0
        self._relations: dict[int, pgoutput.Relation] = {}
        self._last_feedback = 0.0
        self._m = _metrics()

    # -- setup ------------------------------------------------------------------------------

    def _replication_connection(self) -> psycopg2.extensions.connection:
        # wal_sender_timeout=0: see the module docstring (no keepalive inside a transaction).
        conn: psycopg2.extensions.connection = psycopg2.connect(
            self.database_url,
            connection_factory=psycopg2.extras.LogicalReplicationConnection,
            options="-c wal_sender_timeout=0",
        )
        return conn

    def _ensure_publication(self, conn: SyncConnection) -> None:
        level = bookkeeping.wal_level(conn)
        if level != "logical":
            raise ConfigError(
                f"the CDC relay needs wal_level=logical (the server has "
                f"{level or 'unknown'}): set it and restart PostgreSQL, "
                "or run `calmq relay --mode polling`",
                code="wal_level_not_logical",
            )
        if not bookkeeping.publication_exists(conn, self.publication):
            # DuplicateObject: another relay made it at the same moment.
            with contextlib.suppress(psycopg.errors.DuplicateObject):
                bookkeeping.create_publication(conn, self.publication)

    def _wait_inactive(self, conn: SyncConnection, stop: threading.Event) -> SlotState | None:
        """The slot's state once no other process streams from it (None: no slot)."""
        warned = 0.0
        while True:
            state = bookkeeping.slot_state(conn, self.slot)
            if state is None or not state.active:
                return state
            if time.monotonic() - warned > 30:
                # After kill -9 the old walsender exits as soon as it sees the socket close;
                # a live relay on the same slot keeps this one waiting as a standby.
                log.warning("slot %s is in use by server process %s; waiting",
                            self.slot, state.active_pid)
                warned = time.monotonic()
            if stop.wait(0.2):
                return state

    def _create_slot_and_catch_up(self, rconn: psycopg2.extensions.connection,
                                  conn: SyncConnection, stop: threading.Event) -> bool:
        """Create the slot and publish what committed before it; False if stopped."""
        bookkeeping.mark_pending(conn, self.slot)
        cur = rconn.cursor()
        # PostgreSQL 17+: a failover slot, which a standby with sync_replication_slots keeps
        # a copy of, so a promoted standby streams on from it (docs/how-to/relay.md).
        failover = ", FAILOVER true" if bookkeeping.server_version(conn) >= 170000 else ""
        cur.execute(f"CREATE_REPLICATION_SLOT {self.slot} LOGICAL pgoutput "
                    f"(SNAPSHOT 'export'{failover})")
        created = cur.fetchone()
        consistent_lsn, snapshot_name = created[1], created[2]
        log.info("created slot %s at %s; publishing rows committed before it",
                 self.slot, consistent_lsn)
        count = 0
        # The exported snapshot lives until the next command on the replication connection.
        with conn.transaction():
            bookkeeping.use_snapshot(conn, snapshot_name)
            # The polling relay's cursor as of the snapshot: what it published already.
            after = bookkeeping.load_position(conn, self.cursor_name)
            with contextlib.closing(bookkeeping.snapshot_rows(conn, after)) as rows:
                for row in rows:
                    self.publisher.send(row)
                    count += 1
                    if stop.is_set():
                        break
        self.publisher.flush()
        if stop.is_set():
            return False
        bookkeeping.mark_caught_up(conn, self.slot, consistent_lsn)
        self.published += count
        log.info("slot %s caught up: %d rows published from its snapshot", self.slot, count)
        return True

    def prepare(self, stop: threading.Event) -> psycopg2.extensions.connection | None:
        """Publication, slot and catch-up; the replication connection ready to stream."""
        with bookkeeping.connect(self.database_url) as conn:
            self._ensure_publication(conn)
            state = self._wait_inactive(conn, stop)
            if stop.is_set():
                return None
            if state is not None and state.ours and not state.caught_up:
                log.warning("slot %s has no finished catch-up: dropping and making it again",
                            self.slot)
                bookkeeping.drop_slot(conn, self.slot)
                state = None
            elif state is None and (made := bookkeeping.slot_recorded(conn, self.slot)):
                # The relay made this slot and caught it up, and the server has none: this
                # is a promoted standby that did not synchronise it (PostgreSQL < 17, or no
                # sync_replication_slots). What the old slot had not confirmed is unknown,
                # so every outbox row still in the table is published again (consumers
                # dedup by event id); rows pruned were published before.
                log.error("slot %s (caught up %s) is gone from this server: a failover to a "
                          "standby that did not synchronise it; making it again and "
                          "re-publishing the outbox rows not yet pruned", self.slot, made)
                self._m["lost"].labels(self.slot).inc()
            elif state is not None and not state.ours:
                # Made by another relay (Debezium's connector): it confirmed only what it
                # published, so streaming on from it loses nothing.
                log.info("adopting existing slot %s at %s", self.slot, state.confirmed_flush_lsn)
                bookkeeping.mark_caught_up(conn, self.slot, state.confirmed_flush_lsn)
            rconn = self._replication_connection()
            try:
                if state is None and not self._create_slot_and_catch_up(rconn, conn, stop):
                    rconn.close()
                    return None
                if state is not None and bookkeeping.slot_failover(conn, self.slot) is False:
                    # A slot made before PostgreSQL 17 (or by another tool): let standbys
                    # synchronise it from now on.
                    rconn.cursor().execute(f"ALTER_REPLICATION_SLOT {self.slot} "
                                           "(FAILOVER true)")
                    log.info("slot %s is now a failover slot", self.slot)
            except BaseException:
                rconn.close()
                raise
            return rconn

    # -- streaming --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Relay until ``stop`` is set; then flush, confirm what Kafka acked, and return.

        A lost connection to PostgreSQL or a record Kafka refused starts the stream again
        from the slot (after a growing pause): the unconfirmed transactions are sent again.
        """
        # Jittered: relays (and their database) restarted together do not retry in step.
        reconnect = Reconnect("relay interrupted, resuming from the slot", _RESUME)
        while not stop.is_set():
            try:
                self._run_once(stop)
                return
            except (psycopg2.OperationalError, psycopg.OperationalError,
                    InfrastructureError) as exc:
                if stop.wait(reconnect.failed(exc)):
                    return

    def _run_once(self, stop: threading.Event) -> None:
        rconn = self.prepare(stop)
        if rconn is None:
            return
        finished = threading.Event()
        keeper = threading.Thread(target=self._housekeeping, args=(finished,),
                                  name="relay-housekeeping", daemon=True)
        keeper.start()
        try:
            self._stream(rconn, stop)
        finally:
            rconn.close()
            finished.set()
            keeper.join(timeout=10)

    def _stream(self, rconn: psycopg2.extensions.connection, stop: threading.Event) -> None:
        cur = rconn.cursor()
        cur.start_replication(
            slot_name=self.slot, decode=False, status_interval=1,
            options={"proto_version": "1", "publication_names": self.publication},
        )
        log.info("streaming slot %s (publication %s)", self.slot, self.publication)
        ledger = PendingTransactions()
        txn: _Txn | None = None
        publisher = self.publisher
        lag_seconds = self._m["lag_seconds"].labels(self.slot)
        published = self._m["published"].labels(self.slot)
        since_poll = 0
        while not stop.is_set():
            try:
                msg = cur.read_message()
            except psycopg2.OperationalError:
                raise
            except psycopg2.DatabaseError as exc:
                # PostgreSQL shutting down (a restart, a failover) ends the stream's COPY,
                # which psycopg2 reports as "no COPY in progress", a DatabaseError but not an
                # OperationalError: resume from the slot as from any lost connection (the
                # relay exited instead when the chaos test restarted PostgreSQL).
                raise InfrastructureError(f"the replication stream ended: {exc}") from exc
            if msg is None:
                # Wake for new WAL at once; while records await acks, serve them every 2 ms.
                if ledger.pending:
                    select.select([rconn], [], [], 0.002)
                    publisher.poll(0)
                    self._confirm(cur, ledger, lag_seconds, published)
                else:
                    lag_seconds.set(0)
                    select.select([rconn], [], [], 0.2)
                continue
            message = pgoutput.decode(msg.payload)
            if isinstance(message, pgoutput.Insert):
                if txn is None:
                    raise InfrastructureError("pgoutput sent an Insert outside a transaction")
                row = self._row(message)
                if row is None:
                    continue
                acked = ledger.sent(txn)
                if self.on_ack is not None:
                    acked = self._with_hook(acked, row, txn.commit_time)
                publisher.send(row, acked)
                since_poll += 1
                if since_poll >= 1000:
                    publisher.poll(0)
                    since_poll = 0
                while ledger.in_flight > self.max_in_flight and not stop.is_set():
                    publisher.poll(0.01)
            elif isinstance(message, pgoutput.Begin):
                txn = ledger.begin(message.xid, message.commit_time)
            elif isinstance(message, pgoutput.Commit):
                if txn is None:
                    raise InfrastructureError("pgoutput sent a Commit outside a transaction")
                ledger.commit(txn, message.end_lsn)
                txn = None
                publisher.poll(0)
                since_poll = 0
                self._confirm(cur, ledger, lag_seconds, published)
            elif isinstance(message, pgoutput.Relation):
                self._relations[message.relation_id] = message
        # SIGTERM: every record produced so far is acked (or the flush raises), then the
        # finished transactions are confirmed before the process exits.
        publisher.flush()
        self._confirm(cur, ledger, lag_seconds, published)
        cur.send_feedback(force=True)
        log.info("relay stopped at %s after %d rows", lsn_text(self.confirmed_lsn),
                 self.published)

    def _with_hook(self, acked: Callable[[], None], row: OutboxRow,
                   commit_time: datetime) -> Callable[[], None]:
        hook = self.on_ack
        assert hook is not None

        def both() -> None:
            acked()
            hook(row, commit_time)

        return both

    def _row(self, insert: pgoutput.Insert) -> OutboxRow | None:
        relation = self._relations.get(insert.relation_id)
        if relation is None:
            raise InfrastructureError(f"Insert for relation {insert.relation_id} before its "
                                      "Relation message")
        if relation.name != OUTBOX_TABLE:
            return None  # a publication widened by hand: only outbox rows are events
        values = pgoutput.row_as_dict(relation, insert)
        return OutboxRow(
            str(values["id"]), str(values["aggregatetype"]), str(values["aggregateid"]),
            str(values["type"]), json.loads(values["payload"] or "null"),
            json.loads(values["headers"] or "{}"),
        )

    def _confirm(self, cur: Any, ledger: PendingTransactions, lag_seconds: Any,
                 published: Any) -> None:
        done = ledger.confirmable()
        if done is None:
            return
        # psycopg2 reports on its own only every status_interval; sending at most every
        # 100 ms keeps what a crash repeats small without a message per transaction.
        now = time.monotonic()
        force = now - self._last_feedback >= 0.1
        cur.send_feedback(flush_lsn=done.end_lsn, force=force)
        if force:
            self._last_feedback = now
        self.confirmed_lsn = done.end_lsn
        self.transactions += done.transactions
        self.published += done.records
        published.inc(done.records)
        lag_seconds.set(max(0.0, (datetime.now(UTC) - done.commit_time).total_seconds()))

    # -- housekeeping -----------------------------------------------------------------------

    def _housekeeping(self, stop: threading.Event) -> None:
        horizons: deque[tuple[float, Horizon]] = deque()
        warned = 0.0
        conn: SyncConnection | None = None
        try:
            while not stop.is_set():
                try:
                    if conn is None or conn.closed:
                        conn = bookkeeping.connect(self.database_url)
                    warned = self._housekeep_once(conn, horizons, warned, stop)
                except psycopg.Error as exc:
                    log.warning("relay housekeeping failed, will retry: %s", exc)
                    if conn is not None:
                        conn.close()
                    conn = None
                stop.wait(self.housekeeping_seconds)
        finally:
            if conn is not None:
                conn.close()

    def _housekeep_once(self, conn: SyncConnection, horizons: deque[tuple[float, Horizon]],
                        warned: float, stop: threading.Event) -> float:
        lag = bookkeeping.slot_lag(conn, self.slot)
        if lag is None:
            return warned
        self._m["lag_bytes"].labels(self.slot).set(lag.lag_bytes)
        self._m["retained_bytes"].labels(self.slot).set(lag.retained_bytes)
        retained = lag.retained_bytes
        if retained > self.wal_warn_bytes and time.monotonic() - warned > 60:
            log.warning("slot %s holds back %d bytes of WAL, more than relay_wal_warn_bytes "
                        "(%d): is the relay keeping up? `calmq relay --drop-slot` removes an "
                        "abandoned slot", self.slot, retained, self.wal_warn_bytes)
            warned = time.monotonic()
        now = time.monotonic()
        horizon = bookkeeping.horizon(conn)
        if horizon is not None:
            horizons.append((now, horizon))
            if len(horizons) > 10_000:
                # A slot that confirms nothing for days: forgetting the oldest horizon only
                # delays deletion, it never deletes an unpublished row.
                horizons.popleft()
        # The newest horizon older than the retention whose WAL position the slot confirmed.
        chosen = None
        while horizons and horizons[0][0] <= now - self.retention_seconds \
                and horizons[0][1].lsn <= lag.confirmed_lsn:
            chosen = horizons.popleft()[1]
        if chosen is not None:
            while True:
                deleted = bookkeeping.prune_published(conn, chosen.xmin, self.prune_batch)
                self.pruned += deleted
                self._m["pruned"].labels(self.slot).inc(deleted)
                if deleted < self.prune_batch or stop.is_set():
                    break
        return warned
