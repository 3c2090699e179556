"""The outbox relay's bookkeeping: cursor, replication slot, horizon, outbox pages and pruning.

The relay speaks the replication protocol on psycopg2 and keeps its bookkeeping on sync
psycopg connections of its own (one per thread), so every function here takes the caller's
connection rather than a pool; the replication stream itself stays in ``calmq.relay``.
Connections are autocommit with dict rows (``connect``).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.sql
from psycopg.rows import DictRow, dict_row

from calmq import sql

__all__ = [
    "OUTBOX_TABLE",
    "Horizon",
    "OutboxPosition",
    "OutboxRow",
    "SlotLag",
    "SlotState",
    "SyncConnection",
    "connect",
    "create_publication",
    "drop_slot",
    "forget_slot",
    "horizon",
    "load_position",
    "mark_caught_up",
    "mark_pending",
    "outbox_page",
    "prune_outbox",
    "prune_published",
    "publication_exists",
    "save_position",
    "server_version",
    "slot_failover",
    "slot_lag",
    "slot_recorded",
    "slot_state",
    "snapshot_rows",
    "use_snapshot",
    "wal_level",
]

SyncConnection = psycopg.Connection[DictRow]

# The table the router publishes: only its inserts are events.
OUTBOX_TABLE = "outbox"


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One outbox row as the router publishes it (Debezium's Outbox Event Router columns)."""

    id: str
    aggregatetype: str
    aggregateid: str
    type: str
    payload: dict[str, Any]
    headers: dict[str, str]


@dataclass(frozen=True, slots=True, order=True)
class OutboxPosition:
    """A place in the outbox's commit order: ``(txid, seq)``; the start is ``("0", 0)``."""

    txid: str = "0"
    seq: int = 0


@dataclass(frozen=True, slots=True)
class SlotState:
    slot_name: str
    active: bool
    active_pid: int | None
    confirmed_flush_lsn: str | None
    ours: bool  # the relay made it (a relay_slots row), not another tool such as Debezium
    caught_up: bool  # and published the rows committed before it existed


@dataclass(frozen=True, slots=True)
class SlotLag:
    lag_bytes: int  # WAL written since the last confirmed transaction
    retained_bytes: int  # WAL the server keeps for the slot
    confirmed_lsn: int


@dataclass(frozen=True, slots=True)
class Horizon:
    """The snapshot's xmin and the WAL insert position read after it (relay_horizon)."""

    xmin: str
    lsn: int


def connect(database_url: str) -> SyncConnection:
    """A bookkeeping connection: autocommit, dict rows."""
    return psycopg.connect(database_url, autocommit=True, row_factory=dict_row)


def _row(row: DictRow) -> OutboxRow:
    return OutboxRow(str(row["id"]), row["aggregatetype"], row["aggregateid"], row["type"],
                     row["payload"], row["headers"])


# -- publication and slot -------------------------------------------------------------------


def wal_level(conn: SyncConnection) -> str | None:
    row = conn.execute(sql.queries()["relay_wal_level"]).fetchone()
    return str(row["wal_level"]) if row is not None else None


def publication_exists(conn: SyncConnection, publication: str) -> bool:
    found = conn.execute(sql.queries()["relay_publication_exists"],
                         {"publication": publication}).fetchone()
    return found is not None


def create_publication(conn: SyncConnection, publication: str) -> None:
    """A publication of the outbox's inserts only: the router publishes events, never later
    edits or deletions. Raises DuplicateObject if it exists (another relay made it)."""
    conn.execute(psycopg.sql.SQL("CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert')")
                 .format(psycopg.sql.Identifier(publication),
                         psycopg.sql.Identifier(OUTBOX_TABLE)))


def slot_state(conn: SyncConnection, slot: str) -> SlotState | None:
    row = conn.execute(sql.queries()["relay_slot"], {"slot": slot}).fetchone()
    if row is None:
        return None
    return SlotState(row["slot_name"], row["active"], row["active_pid"],
                     row["confirmed_flush_lsn"], row["ours"], row["caught_up"])


def slot_recorded(conn: SyncConnection, slot: str) -> str | None:
    """When the relay finished the slot's catch-up, as relay_slots remembers it (None: it
    never did, or made no such slot). A slot remembered here that the server lacks was lost:
    a failover to a standby that did not synchronise it."""
    row = conn.execute(sql.queries()["relay_slot_record"], {"slot": slot}).fetchone()
    return str(row["caught_up_at"]) if row is not None and row["caught_up"] else None


def server_version(conn: SyncConnection) -> int:
    row = conn.execute(sql.queries()["relay_server_version"]).fetchone()
    return int(row["version"]) if row is not None else 0


def slot_failover(conn: SyncConnection, slot: str) -> bool | None:
    """Whether the slot is a failover slot (PostgreSQL 17+; None before, or no slot)."""
    if server_version(conn) < 170000:
        return None
    row = conn.execute(sql.queries()["relay_slot_failover"], {"slot": slot}).fetchone()
    return bool(row["failover"]) if row is not None else None


def drop_slot(conn: SyncConnection, slot: str) -> None:
    """Drop the replication slot itself (its relay_slots record stays: see forget_slot)."""
    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def forget_slot(conn: SyncConnection, slot: str) -> None:
    conn.execute(sql.queries()["relay_forget_slot"], {"slot": slot})


def mark_pending(conn: SyncConnection, slot: str) -> None:
    """Record that the slot's catch-up has begun and not finished."""
    conn.execute(sql.queries()["relay_mark_pending"], {"slot": slot})


def mark_caught_up(conn: SyncConnection, slot: str, lsn: str | None) -> None:
    conn.execute(sql.queries()["relay_mark_caught_up"], {"slot": slot, "lsn": lsn})


def slot_lag(conn: SyncConnection, slot: str) -> SlotLag | None:
    row = conn.execute(sql.queries()["relay_slot_lag"], {"slot": slot}).fetchone()
    if row is None:
        return None
    return SlotLag(int(row["lag_bytes"] or 0), int(row["retained_bytes"] or 0),
                   int(row["confirmed_lsn"] or 0))


def horizon(conn: SyncConnection) -> Horizon | None:
    row = conn.execute(sql.queries()["relay_horizon"]).fetchone()
    return Horizon(row["xmin"], int(row["lsn"])) if row is not None else None


# -- the outbox -----------------------------------------------------------------------------


def load_position(conn: SyncConnection, name: str) -> OutboxPosition:
    """How far the polling relay named ``name`` published (the start if never)."""
    row = conn.execute(sql.queries()["relay_cursor"], {"name": name}).fetchone()
    return OutboxPosition(row["txid"], row["seq"]) if row is not None else OutboxPosition()


def save_position(conn: SyncConnection, name: str, position: OutboxPosition) -> None:
    conn.execute(sql.queries()["save_relay_cursor"],
                 {"name": name, "txid": position.txid, "seq": position.seq})


def outbox_page(conn: SyncConnection, after: OutboxPosition,
                limit: int) -> tuple[list[OutboxRow], OutboxPosition]:
    """Up to ``limit`` committed rows after ``after``, and the position of the last one."""
    rows = conn.execute(sql.queries()["outbox_page"],
                        {"txid": after.txid, "seq": after.seq, "limit": limit}).fetchall()
    if not rows:
        return [], after
    last = rows[-1]
    return [_row(r) for r in rows], OutboxPosition(str(last["txid"]), int(last["seq"]))


def use_snapshot(conn: SyncConnection, snapshot: str) -> None:
    """Make the transaction just begun on ``conn`` see exactly the exported ``snapshot``;
    it must come before any other statement of that transaction."""
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    conn.execute(psycopg.sql.SQL("SET TRANSACTION SNAPSHOT {}").format(
        psycopg.sql.Literal(snapshot)))


def snapshot_rows(conn: SyncConnection, after: OutboxPosition) -> Generator[OutboxRow]:
    """Rows after ``after``, streamed by a server-side cursor inside the caller's open
    transaction (after ``use_snapshot``: the rows committed before the slot existed)."""
    with conn.cursor(name="relay_snapshot") as rows:
        rows.execute(sql.queries()["relay_snapshot_rows"], {"txid": after.txid, "seq": after.seq})
        for r in rows:
            yield _row(r)


def prune_outbox(conn: SyncConnection, upto: OutboxPosition, retention_seconds: float) -> int:
    """Delete published rows at or before ``upto`` older than the retention; how many."""
    return conn.execute(sql.queries()["prune_outbox"],
                        {"txid": upto.txid, "seq": upto.seq,
                         "retention_seconds": retention_seconds}).rowcount


def prune_published(conn: SyncConnection, xmin: str, limit: int) -> int:
    """Delete one batch (``limit``) of rows of transactions below ``xmin``; how many."""
    return conn.execute(sql.queries()["relay_prune_published"],
                        {"xmin": xmin, "limit": limit}).rowcount
