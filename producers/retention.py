"""Deleting a job's data: on request (DELETE /v1/jobs/{id}) and by age (the retention sweep).

A purge deletes the job's input and artifact objects first, then redacts its row (input,
metadata, callback, artifact and error details gone; status and history kept for audit).
Objects first: if the process dies in between, the row still names them and the next
purge or sweep finishes the work; the reverse order could leave objects nobody points at.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from calmq import sql
from calmq.errors import ContractError, NotFound
from calmq.jobs import TERMINAL
from calmq.objects import ObjectStore
from calmq.producers.uploads import delete_object, tenant_owns
from calmq.settings import Settings
from calmq.store import Store

__all__ = ["Sweeper", "purge"]

async def purge(store: Store, objects: ObjectStore, settings: Settings,
                tenant_id: uuid.UUID, job_id: uuid.UUID) -> None:
    """Delete a terminal job's objects and redact its record; NotFound, or 409 if not terminal."""
    q = sql.queries()
    async with store.pool.connection() as conn:
        cur = await conn.execute(q["api_job_status"], {"id": job_id, "tenant_id": tenant_id})
        row = await cur.fetchone()
    if row is None:
        raise NotFound("no such job")
    if row["status"] not in TERMINAL:
        raise ContractError(f"the job is {row['status']}; cancel it before deleting it",
                            code="job_not_terminal", status=409)
    if row["redacted_at"] is not None:
        return
    # Only objects inside the tenant's own prefix: an input_ref is checked at submit, but
    # a purge must never be the way to delete something else.
    uris = [row["input_ref"], (row["artifact"] or {}).get("uri")]
    for uri in uris:
        if uri and tenant_owns(settings.object_store_url, tenant_id, uri):
            await delete_object(objects, uri)
    async with store.pool.connection() as conn, conn.transaction():
        await conn.execute(q["api_redact_job"], {"id": job_id, "tenant_id": tenant_id})
        await conn.execute(q["api_redact_events"], {"id": job_id})


class Sweeper:
    """Retention: old idempotency keys and old terminal jobs' data, one ``sweep`` a pass."""

    def __init__(self, settings: Settings, store: Store, objects: ObjectStore,
                 interval: float = 60.0) -> None:
        self._settings = settings
        self._store = store
        self._objects = objects
        self.interval = interval  # between sweeps, run as a side task (calmq.supervision)

    async def sweep(self, limit: int = 500) -> dict[str, int]:
        """One pass; returns how many keys were pruned and jobs purged."""
        q = sql.queries()
        async with self._store.pool.connection() as conn:
            cur = await conn.execute(q["api_prune_idempotency_keys"], {
                "retention_seconds": self._settings.idempotency_retention_seconds})
            keys = cur.rowcount
        purged = 0
        if self._settings.job_retention_seconds > 0:
            async with self._store.pool.connection() as conn:
                cur = await conn.execute(q["api_expired_jobs"], {
                    "retention_seconds": self._settings.job_retention_seconds, "limit": limit})
                rows: list[dict[str, Any]] = await cur.fetchall()
            for r in rows:
                with contextlib.suppress(NotFound, ContractError):
                    await purge(self._store, self._objects, self._settings,
                                r["tenant_id"], r["id"])
                    purged += 1
        return {"idempotency_keys": keys, "jobs": purged}
