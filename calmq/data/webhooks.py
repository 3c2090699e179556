"""Webhook deliveries: claiming the due ones, and recording each attempt's outcome.

The rows are written by the job_events trigger (migration 0004) in the transaction of the
terminal event, so a callback is never lost; the dispatcher (calmq.producers.webhooks)
only claims, sends and records.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from calmq.data.database import Database

__all__ = ["DeliveryStatus", "WebhookDeliveries", "WebhookDelivery"]

DeliveryStatus = Literal["delivered", "failed", "pending"]


@dataclass(frozen=True, slots=True)
class WebhookDelivery:
    """A claimed delivery; ``attempts`` counts this one."""

    id: uuid.UUID
    job_id: uuid.UUID
    tenant_id: uuid.UUID
    url: str
    event_type: str
    attempts: int
    webhook_secret: str
    # When the event was recorded (the row is written in the event's transaction): the
    # body's ``timestamp``, the same on every retry.
    created_at: datetime
    # The secret the last rotation replaced, while its grace lasts; deliveries are signed
    # with both meanwhile.
    webhook_secret_previous: str | None = None


class WebhookDeliveries:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def next_due(self, full: Collection[uuid.UUID] = ()) -> float | None:
        """Seconds until the next pending delivery of a tenant not in ``full`` is due
        (negative: overdue); None if none."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["webhook_next_due"], {"full": list(full)})
            row = await cur.fetchone()
        return None if row is None or row["seconds"] is None else float(row["seconds"])

    async def claim(self, limit: int, lease_seconds: float, *, per_tenant: int,
                    held: Mapping[uuid.UUID, int] | None = None) -> list[WebhookDelivery]:
        """Due deliveries for this dispatcher, each leased for ``lease_seconds`` (SKIP LOCKED:
        several API processes share the work), oldest first: at most ``per_tenant`` in
        flight per tenant, counting the ``held`` ones this dispatcher is sending."""
        held = {t: n for t, n in (held or {}).items() if n > 0}
        full = [t for t, n in held.items() if n >= per_tenant]
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["webhook_claim"], {
                "limit": limit, "lease_seconds": lease_seconds, "per_tenant": per_tenant,
                "tenants": list(held), "held": list(held.values()), "full": full,
                # Enough rows that a few busy tenants at the front cannot hide the others.
                "scan": max(limit * 8, per_tenant * 8, 256)})
            rows = await cur.fetchall()
        return [WebhookDelivery(r["id"], r["job_id"], r["tenant_id"], r["url"], r["event_type"],
                                r["attempts"], r["webhook_secret"], r["created_at"],
                                r["webhook_secret_previous"]) for r in rows]

    async def record(
        self, delivery: WebhookDelivery, *, status: DeliveryStatus, status_code: int | None,
        error: str | None, duration_ms: int, retry_in: float,
    ) -> None:
        """The attempt and the delivery's new status in one transaction; a ``pending``
        delivery is due again in ``retry_in`` seconds."""
        async with self._db.pool.connection() as conn, conn.transaction():
            await conn.execute(self._db.q["webhook_attempt"], {
                "id": delivery.id, "attempt": delivery.attempts, "status_code": status_code,
                "error": error, "duration_ms": duration_ms})
            await conn.execute(self._db.q["webhook_done"], {
                "id": delivery.id, "status": status, "delay_seconds": retry_in})
