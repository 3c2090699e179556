"""What the metrics samplers read from PostgreSQL (docs/reference/metrics.md)."""

from __future__ import annotations

from calmq.data.database import Database

__all__ = ["queue_ages"]


async def queue_ages(db: Database) -> dict[tuple[str, str], float]:
    """Seconds the oldest waiting (queued or retrying) job has waited, by (pool, priority);
    pairs with nothing waiting are absent."""
    async with db.pool.connection() as conn:
        cur = await conn.execute(db.q["obs_queue_age"])
        rows = await cur.fetchall()
    return {(str(r["pool"]), str(r["priority"])): float(r["age_seconds"]) for r in rows}
