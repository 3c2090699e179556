"""What the metrics samplers read from PostgreSQL (docs/reference/metrics.md)."""

from __future__ import annotations

from dataclasses import dataclass

from calmq.data.database import Database

__all__ = ["SlotState", "TableHealth", "TransactionAges", "queue_ages", "replication_slots",
           "table_health", "transaction_ages"]


@dataclass(frozen=True, slots=True)
class SlotState:
    """One replication slot of the database, as the server sees it."""

    slot: str
    active: bool  # a process (a relay) streams from it now
    retained_bytes: int  # WAL the server keeps for it: current position - restart_lsn


@dataclass(frozen=True, slots=True)
class TableHealth:
    """One of calmq's tables (a partitioned one summed over its partitions), as the
    server's cumulative statistics estimate it."""

    table: str
    live: int
    dead: int
    since_vacuum_seconds: float | None  # None: never vacuumed since the statistics reset

    @property
    def dead_ratio(self) -> float:
        """Dead tuples over all tuples: the share of the table vacuum has yet to reclaim."""
        total = self.live + self.dead
        return self.dead / total if total else 0.0


@dataclass(frozen=True, slots=True)
class TransactionAges:
    xid_age: int  # age of the database's oldest unfrozen transaction ID
    oldest_transaction_seconds: float  # the longest-running open transaction of a client
    slot_xmin_age: int  # age of the oldest xmin a replication slot holds back (0: none)
    notification_queue_usage: float = 0.0  # share of the NOTIFY queue in use, 0 to 1


async def queue_ages(db: Database) -> dict[tuple[str, str], float]:
    """Seconds the oldest waiting (queued or retrying) job has waited, by (pool, priority);
    pairs with nothing waiting are absent."""
    async with db.pool.connection() as conn:
        cur = await conn.execute(db.q["obs_queue_age"])
        rows = await cur.fetchall()
    return {(str(r["pool"]), str(r["priority"])): float(r["age_seconds"]) for r in rows}


async def replication_slots(db: Database) -> list[SlotState]:
    """Every replication slot of this database, by name; an empty list when there is none
    (the polling relay, or wal_level below logical)."""
    async with db.pool.connection() as conn:
        cur = await conn.execute(db.q["obs_replication_slots"])
        rows = await cur.fetchall()
    return [SlotState(str(r["slot"]), bool(r["active"]), int(r["retained_bytes"]))
            for r in rows]


async def table_health(db: Database) -> list[TableHealth]:
    """Live and dead tuples of every table of calmq's schema, by table name."""
    async with db.pool.connection() as conn:
        cur = await conn.execute(db.q["obs_table_health"])
        rows = await cur.fetchall()
    return [TableHealth(str(r["table"]), int(r["live"] or 0), int(r["dead"] or 0),
                        None if r["since_vacuum_seconds"] is None
                        else float(r["since_vacuum_seconds"])) for r in rows]


async def transaction_ages(db: Database) -> TransactionAges:
    """How near wraparound the database is and how old its oldest open transaction is."""
    async with db.pool.connection() as conn:
        cur = await conn.execute(db.q["obs_transaction_ages"])
        row = await cur.fetchone()
    assert row is not None  # one row by construction
    return TransactionAges(int(row["xid_age"]), float(row["oldest_transaction_seconds"]),
                           int(row["slot_xmin_age"]),
                           float(row["notification_queue_usage"]))
