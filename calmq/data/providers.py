"""The fleet's provider states as rows (table provider_states, migration 0019): blocks,
rate-limit pauses and the limits providers state; and the hand-back of a job whose attempt
met a blocked provider. What is blocked when is calmq.calls.gate'.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from calmq.data.database import Database
from calmq.data.jobs import Job, republish

__all__ = ["CHANNEL", "ProviderLedger", "ProviderState"]

# The LISTEN/NOTIFY channel that tells every worker of a block, a lift or a pause at once.
CHANNEL = "calmq_providers"


@dataclass(frozen=True, slots=True)
class ProviderState:
    provider: str
    model: str
    blocked_reason: str | None
    blocked_code: str | None
    blocked_message: str | None
    blocked_at: datetime | None
    paused_seconds: float
    observed_tokens_per_minute: int | None
    observed_requests_per_minute: int | None
    observed_at: datetime | None


class ProviderLedger:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def _notify(self, conn: Any, payload: dict[str, Any]) -> None:
        await conn.execute(self._db.q["provider_notify"], {"payload": json.dumps(payload)})

    async def block(self, provider: str, model: str, reason: str, code: str,
                    message: str) -> None:
        async with self._db.pool.connection() as conn:
            await conn.execute(self._db.q["provider_block"], {
                "provider": provider, "model": model, "reason": reason, "code": code,
                "message": message[:1000]})
            await self._notify(conn, {"event": "blocked", "provider": provider,
                                      "model": model, "reason": reason, "code": code,
                                      "message": message[:300]})

    async def unblock(self, provider: str | None = None,
                      model: str | None = None) -> list[tuple[str, str]]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["provider_unblock"],
                                     {"provider": provider, "model": model})
            lifted = [(r["provider"], r["model"]) for r in await cur.fetchall()]
            for p, m in lifted:
                await self._notify(conn, {"event": "unblocked", "provider": p, "model": m})
        return lifted

    async def unpause(self, provider: str | None = None,
                      model: str | None = None) -> list[tuple[str, str, str]]:
        """Lift rate-limit pauses now (the gates' and the token budgets'); returns each
        lifted one as (provider, model, ``provider`` or ``budget``)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["provider_unpause"],
                                     {"provider": provider, "model": model})
            lifted = [(r["provider"], r["model"], r["pause"]) for r in await cur.fetchall()]
            for p, m, pause in lifted:
                if pause == "provider":
                    await self._notify(conn, {"event": "unpaused", "provider": p, "model": m})
        return lifted

    async def pause(self, provider: str, model: str, seconds: float) -> float:
        """Pause fleet-wide for ``seconds``; returns how long the pause now runs."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["provider_pause"], {
                "provider": provider, "model": model, "seconds": seconds})
            row = await cur.fetchone()
            left = float(row["seconds_left"]) if row is not None else seconds
            await self._notify(conn, {"event": "paused", "provider": provider,
                                      "model": model, "seconds": left})
        return left

    async def observe(self, provider: str, model: str, tokens_per_minute: int | None,
                      requests_per_minute: int | None) -> None:
        async with self._db.pool.connection() as conn:
            await conn.execute(self._db.q["provider_observe"], {
                "provider": provider, "model": model, "tokens_per_minute": tokens_per_minute,
                "requests_per_minute": requests_per_minute})

    async def states(self) -> list[ProviderState]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["provider_states"])
            return [ProviderState(**r) for r in await cur.fetchall()]

    async def hand_back(self, job_id: uuid.UUID, lease_version: int, worker: str,
                        detail: dict[str, Any], *, reason: str = "provider_blocked",
                        wait_seconds: float | None = None) -> bool:
        """The job back to queued, waiting for its provider (``reason``: ``provider_blocked``
        until the block lifts, ``model_cooldown`` for ``wait_seconds``), with no attempt
        counted."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["provider_hand_back"], {
                "id": job_id, "lease_version": lease_version, "worker": worker,
                "reason": reason, "wait_seconds": wait_seconds,
                "detail": json.dumps({"reason": reason, **detail})})
            return await cur.fetchone() is not None

    async def met_before(self, job_id: uuid.UUID) -> bool:
        """Whether ``job_id`` was handed back once already after its own call met a blocked
        provider's refusal."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["provider_met_before"], {"id": job_id})
            row = await cur.fetchone()
        return bool(row and row["met"])

    async def release_waited(self, limit: int = 1000) -> list[tuple[Job, str]]:
        """Re-publish (through the outbox, in the same transaction) up to ``limit`` jobs
        whose timed wait (``model_cooldown``, ``rate_limit_key``) is over, with the reason
        each waited for."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._db.q["timed_wait_release_jobs"], {"limit": limit})
            reasons = []
            jobs = []
            for row in await cur.fetchall():
                reasons.append(str(row.pop("waited_for")))
                jobs.append(Job.from_row(row))
            await republish(conn, self._db.q["insert_outbox"], jobs)
        return list(zip(jobs, reasons, strict=True))

    async def release_jobs(self, limit: int = 1000) -> list[Job]:
        """Re-publish (through the outbox, in the same transaction) up to ``limit`` jobs that
        waited for a blocked provider."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._db.q["provider_release_jobs"], {"limit": limit})
            jobs = [Job.from_row(r) for r in await cur.fetchall()]
            await republish(conn, self._db.q["insert_outbox"], jobs)
        return jobs

    async def waiting_jobs(self) -> int:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["provider_waiting_jobs"])
            row = await cur.fetchone()
        return int(row["n"]) if row is not None else 0
