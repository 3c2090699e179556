"""What the metrics samplers read from PostgreSQL (docs/reference/metrics.md)."""

from __future__ import annotations

from dataclasses import dataclass

from calmq.data.database import Database

__all__ = ["SlotState", "queue_ages", "replication_slots"]


@dataclass(frozen=True, slots=True)
class SlotState:
    """One replication slot of the database, as the server sees it."""

    slot: str
    active: bool  # a process (a relay) streams from it now
    retained_bytes: int  # WAL the server keeps for it: current position - restart_lsn


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
