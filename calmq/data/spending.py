"""Spend caps as rows: the caps of tenants (columns of ``tenants``), what each tenant spent
this day and month (``spend_days`` and the deltas not folded in yet, which a trigger on
``job_attempts`` appends as attempts' cost is written; migration 0038; per hour, with
tokens, for the console: ``spend_hours``, migration 0040; the jobs finished per 5 minutes,
``finish_bins``, migration 0042), and the jobs that
wait past a cap (``jobs.waiting_reason``, migration 0012). What is held when is
calmq.spending's.

The batch lane reserves each packed request's estimated cost (``Charge``) in the
transaction that records its batch (calmq/data/batches.py, ``batch_tenants``, migration
0049): ``standing`` takes the reservation locks of the pack's tenants (and the fleet's) and
reads what they spent and reserved, so that packs reserving against one cap take turns.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from calmq.data.database import Connection, Database
from calmq.data.jobs import Job, republish

__all__ = ["Admit", "Charge", "Spend", "SpendCap", "SpendLedger", "Standing"]


@dataclass(frozen=True, slots=True)
class SpendCap:
    """A tenant's caps in USD; None: no cap for that window."""

    daily: float | None
    monthly: float | None


@dataclass(frozen=True, slots=True)
class Spend:
    """What a tenant spent in USD this UTC day and this UTC month."""

    day: float
    month: float


@dataclass(frozen=True, slots=True)
class Charge:
    """One request's estimated cost in USD, reserved against its tenant's and the fleet's
    caps when it is packed into a provider batch."""

    job_id: uuid.UUID
    tenant_id: uuid.UUID
    priority: str
    cost_usd: float


@dataclass(frozen=True, slots=True)
class Standing:
    """What the tenants of a pack spent this UTC day and month, open reservations included,
    with their caps (a tenant without a row: no cap); ``fleet``: the fleet's, when read."""

    spent: dict[uuid.UUID, Spend]
    caps: dict[uuid.UUID, SpendCap]
    fleet: Spend | None = None


# Which charges may not be reserved now (job id -> the cap's waiting reason), given what is
# spent and reserved: calmq.spending decides, the batch's transaction records.
Admit = Callable[[Standing, Sequence[Charge]], Mapping[uuid.UUID, str]]


class SpendLedger:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def standing(self, conn: Connection, tenants: Sequence[uuid.UUID], *,
                       fleet: bool) -> Standing:
        """On ``conn``, in its transaction: take the reservation locks of ``tenants`` (and
        the fleet's, with ``fleet``), then read what they spent and reserved, and their
        caps. The locks are held until the transaction ends."""
        ids = sorted(set(tenants))
        names = [str(t) for t in ids] + (["fleet"] if fleet else [])
        await conn.execute(self._db.q["spend_reserve_lock"], {"names": names})
        cur = await conn.execute(self._db.q["spend_standing"], {"tenants": ids})
        spent: dict[uuid.UUID, Spend] = {}
        caps: dict[uuid.UUID, SpendCap] = {}
        for r in await cur.fetchall():
            spent[r["tenant_id"]] = Spend(r["spent_day"], r["spent_month"])
            if r["daily"] is not None or r["monthly"] is not None:
                caps[r["tenant_id"]] = SpendCap(r["daily"], r["monthly"])
        total = None
        if fleet:
            cur = await conn.execute(self._db.q["spend_fleet_standing"])
            row = await cur.fetchone()
            total = Spend(row["spent_day"], row["spent_month"]) if row else Spend(0.0, 0.0)
        return Standing(spent, caps, total)

    async def caps(self) -> dict[uuid.UUID, SpendCap]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["spend_caps"])
            return {r["id"]: SpendCap(r["daily"], r["monthly"]) for r in await cur.fetchall()}

    async def spend(self) -> dict[uuid.UUID, Spend]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["spend_by_tenant"])
            return {r["tenant_id"]: Spend(r["day"], r["month"]) for r in await cur.fetchall()}

    async def hold(self, ids: Sequence[uuid.UUID], reason: str, detail: dict[str, Any]
                   ) -> list[uuid.UUID]:
        """Make the waiting ones of ``ids`` wait with ``reason``; returns those newly held."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["hold_jobs"], {
                "ids": list(ids), "reason": reason,
                "detail": json.dumps({"reason": reason, **detail})})
            return [r["id"] for r in await cur.fetchall()]

    async def release(self, *, held_bulk: Sequence[uuid.UUID], held_all: Sequence[uuid.UUID],
                      fleet_bulk: bool, fleet_all: bool, stale_seconds: float = 600.0,
                      limit: int = 500) -> list[Job]:
        """Re-publish (through the outbox, in the same transaction) the waiting jobs that no
        cap holds any more; one pass at a time in the fleet."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._db.q["held_jobs_lock"])
            row = await cur.fetchone()
            if row is None or not row["held"]:
                return []
            # The deltas of spend and of finished jobs folded into their days, hours and
            # bins here: the one pass at a time in the fleet, so that they stay a few
            # seconds long.
            await conn.execute(self._db.q["fold_spend"])
            await conn.execute(self._db.q["fold_spend_hours"])
            await conn.execute(self._db.q["prune_spend_hours"])
            await conn.execute(self._db.q["fold_finish_bins"])
            await conn.execute(self._db.q["prune_finish_bins"])
            cur = await conn.execute(self._db.q["release_jobs"], {
                "held_bulk": list(held_bulk), "held_all": list(held_all),
                "fleet_bulk": fleet_bulk, "fleet_all": fleet_all,
                "stale_seconds": stale_seconds, "limit": limit})
            jobs = [Job.from_row(r) for r in await cur.fetchall()]
            await republish(conn, self._db.q["insert_outbox"], jobs)
        return jobs

    async def quota_held_tenants(self) -> list[uuid.UUID]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["quota_held_tenants"])
            return [r["tenant_id"] for r in await cur.fetchall()]

    async def release_quota(self, limits: dict[uuid.UUID, int]) -> list[Job]:
        """Re-publish up to ``limits[tenant]`` of each tenant's jobs that wait for its token
        quota (through the outbox, in one transaction); one pass at a time in the fleet."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._db.q["quota_lock"])
            row = await cur.fetchone()
            if row is None or not row["held"]:
                return []
            jobs: list[Job] = []
            for tenant_id, limit in sorted(limits.items()):
                cur = await conn.execute(self._db.q["release_quota_jobs"],
                                         {"tenant_id": tenant_id, "limit": limit})
                jobs.extend(Job.from_row(r) for r in await cur.fetchall())
            await republish(conn, self._db.q["insert_outbox"], jobs)
        return jobs

    async def set_quota(self, name: str, tokens_per_minute: int | None) -> bool:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["set_tenant_quota"], {
                "name": name, "tokens_per_minute": tokens_per_minute})
            return await cur.fetchone() is not None

    async def set_cap(self, name: str, *, daily: float | bool | None = False,
                      monthly: float | bool | None = False) -> bool:
        """Set a tenant's caps (None: no cap); a window left False keeps its cap."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["set_tenant_spend_cap"], {
                "name": name,
                "set_daily": daily is not False, "daily": None if daily is False else daily,
                "set_monthly": monthly is not False,
                "monthly": None if monthly is False else monthly})
            return await cur.fetchone() is not None
