"""Spend caps: cost is a constrained resource like tokens.

A tenant (a row's ``spend_cap_daily_usd`` / ``spend_cap_monthly_usd``) and the whole fleet
(settings ``spend_cap_fleet_daily_usd`` / ``_monthly_usd``) may have a cap per UTC day and
per UTC month. What was spent is the attempts' recorded cost (retries and dead-lettered
attempts included), kept per tenant and day as it is written (calmq.data.spending), read
every ``spend_cap_refresh_seconds``.

Work past a cap is never dropped: a worker that polls a job of a capped tenant does not claim
it; the job keeps its status (``queued`` for new work) with a ``waiting_reason`` and a
``waiting`` event, and its message is acknowledged. A release pass (one at a time in the
fleet) clears the reason and re-publishes the job (event ``resumed``) once the window rolled
over or the cap was raised. Bulk work waits first: once spend reaches
``spend_cap_bulk_fraction`` of a cap; interactive work waits at the full cap.

Calls in flight are not stopped, and their cost counts once their attempt ends: a fleet may
pass a cap by what its in-flight attempts spend.

The batch lane's cost comes back with a batch's results, hours after its requests were
sent, so it is reserved when they are packed (``SpendCaps.admit``): each request's estimate
(its prompt's estimated tokens and its max output tokens, at the batch price) counts as
spent from the transaction that records its batch until its result settles it with the
real cost; a batch that ends without a result for it (failed, expired, cancelled) releases
it. A request is packed while its tenant, and the fleet, are below the cap for its priority
counting what is spent and reserved, by the same rule as the holds above; the rest of the
pack waits queued with the cap's reason, as online work does, and the release pass
re-publishes it. So a cap is passed by at most one request's estimate (the one packed while
below it), and a job released by the pass is one a pack takes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from calmq.data.spending import Charge, Spend, SpendCap, SpendLedger, Standing
from calmq.jobs import Priority

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = ["Holds", "SpendCaps", "spend_caps_from_settings"]

log = logging.getLogger(__name__)


@cache
def _held_gauge() -> Gauge:
    return Gauge("calmq_spend_capped_tenants",
                 "Tenants whose work of this priority waits past a spend cap, as this process"
                 " last read them (the fleet's own cap counts as one)", ["priority"])


@dataclass(frozen=True)
class Holds:
    """Who waits right now: per tenant, bulk only or all priorities, and the fleet."""

    bulk: dict[uuid.UUID, str] = field(default_factory=dict)  # tenant -> reason
    every: dict[uuid.UUID, str] = field(default_factory=dict)
    fleet_bulk: str | None = None
    fleet_every: str | None = None

    def reason(self, tenant_id: uuid.UUID, priority: str) -> str | None:
        """Why a job of this tenant and priority must wait now; None: it may run."""
        if self.fleet_every:
            return self.fleet_every
        if tenant_id in self.every:
            return self.every[tenant_id]
        if priority != Priority.INTERACTIVE:
            return self.fleet_bulk or self.bulk.get(tenant_id)
        return None


def _over(spend: Spend, cap: SpendCap, bulk_fraction: float) -> tuple[str | None, str | None]:
    """(reason all work waits, reason bulk work waits) for one spender's caps."""
    every: str | None = None
    bulk: str | None = None
    for window, spent, limit in (("daily", spend.day, cap.daily),
                                 ("monthly", spend.month, cap.monthly)):
        if limit is None:
            continue
        if spent >= limit and every is None:
            every = f"spend_cap_{window}"
        if spent >= limit * bulk_fraction and bulk is None:
            bulk = f"spend_cap_{window}"
    return every, bulk


class SpendCaps:
    """Who is past a cap, read at most every ``refresh_seconds``."""

    def __init__(self, ledger: SpendLedger, *, fleet: SpendCap, bulk_fraction: float,
                 refresh_seconds: float, stale_seconds: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.stale_seconds = stale_seconds  # a token-quota wait no quota pass released
        self.fleet = fleet
        self.bulk_fraction = bulk_fraction
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._holds = Holds()
        self._read_at: float | None = None
        self._reading: asyncio.Future[Holds] | None = None

    def _read(self) -> asyncio.Future[Holds]:
        """The read in flight, or a new one. One read at a time, and a caller that comes
        while one is in flight waits for it: the holds read before it may predate a cap set
        since (the release pass reads every interval, and under load its read takes longer
        than the interval, so the previous holds were up to two reads old), and two reads
        could land out of order."""
        if self._reading is None:
            self._read_at = self._clock()
            reading = self._reading = asyncio.ensure_future(self.refresh())

            def landed(done: asyncio.Future[Holds]) -> None:
                self._reading = None
                if not done.cancelled() and done.exception() is None:
                    self._holds = done.result()

            reading.add_done_callback(landed)
        # A caller cancelled while waiting does not cancel the read the others wait for.
        return asyncio.shield(self._reading)

    async def holds(self) -> Holds:
        """The holds as last read, read again when older than the refresh interval (a read
        in flight is waited for). With the database away the last ones read stand (the
        claim would fail anyway)."""
        now = self._clock()
        if (self._reading is not None or self._read_at is None
                or now - self._read_at >= self.refresh_seconds):
            try:
                return await self._read()
            except Exception as exc:  # noqa: BLE001 - keep the last holds read
                log.warning("reading the spend caps failed: %s", exc)
        return self._holds

    async def refresh(self) -> Holds:
        caps = await self.ledger.caps()
        fleet_capped = self.fleet.daily is not None or self.fleet.monthly is not None
        if not caps and not fleet_capped:
            gauge = _held_gauge()
            gauge.labels(Priority.BULK).set(0)
            gauge.labels(Priority.INTERACTIVE).set(0)
            return Holds()  # nothing capped: no need to sum anything
        spend = await self.ledger.spend()
        bulk: dict[uuid.UUID, str] = {}
        every: dict[uuid.UUID, str] = {}
        for tenant_id, cap in caps.items():
            all_reason, bulk_reason = _over(spend.get(tenant_id, Spend(0.0, 0.0)), cap,
                                            self.bulk_fraction)
            if all_reason:
                every[tenant_id] = all_reason
            if bulk_reason:
                bulk[tenant_id] = bulk_reason
        fleet_every = fleet_bulk = None
        if fleet_capped:
            total = Spend(sum(s.day for s in spend.values()),
                          sum(s.month for s in spend.values()))
            fleet_every, fleet_bulk = _over(total, self.fleet, self.bulk_fraction)
            fleet_every = f"fleet_{fleet_every}" if fleet_every else None
            fleet_bulk = f"fleet_{fleet_bulk}" if fleet_bulk else None
        gauge = _held_gauge()
        gauge.labels(Priority.BULK).set(len(bulk) + (fleet_bulk is not None))
        gauge.labels(Priority.INTERACTIVE).set(len(every) + (fleet_every is not None))
        return Holds(bulk, every, fleet_bulk, fleet_every)

    @property
    def fleet_capped(self) -> bool:
        return self.fleet.daily is not None or self.fleet.monthly is not None

    def admit(self, standing: Standing, charges: Sequence[Charge]) -> dict[uuid.UUID, str]:
        """Which of ``charges`` (in order: the oldest first) may not be reserved now, with
        the reason their jobs wait: a charge is reserved while its tenant and the fleet are
        below the cap for its priority (``Holds``' rule), counting what ``standing`` says
        is spent and reserved and the charges reserved before it."""
        refused: dict[uuid.UUID, str] = {}
        spent = dict(standing.spent)
        fleet = standing.fleet if self.fleet_capped else None
        for charge in charges:
            own = spent.get(charge.tenant_id, Spend(0.0, 0.0))
            reason = None
            if fleet is not None:
                every, bulk = _over(fleet, self.fleet, self.bulk_fraction)
                reason = every if charge.priority == Priority.INTERACTIVE else bulk
                reason = f"fleet_{reason}" if reason else None
            cap = standing.caps.get(charge.tenant_id)
            if reason is None and cap is not None:
                every, bulk = _over(own, cap, self.bulk_fraction)
                reason = every if charge.priority == Priority.INTERACTIVE else bulk
            if reason is not None:
                refused[charge.job_id] = reason
                continue
            spent[charge.tenant_id] = Spend(own.day + charge.cost_usd,
                                            own.month + charge.cost_usd)
            if fleet is not None:
                fleet = Spend(fleet.day + charge.cost_usd, fleet.month + charge.cost_usd)
        return refused

    async def release(self) -> int:
        """Re-publish the waiting jobs no cap holds any more (holds from a read started
        now, or the one in flight: it started after the holds that made the jobs wait);
        how many."""
        holds = await self._read()
        released = await self.ledger.release(
            held_bulk=list(holds.bulk), held_all=list(holds.every),
            fleet_bulk=holds.fleet_bulk is not None, fleet_all=holds.fleet_every is not None,
            stale_seconds=self.stale_seconds)
        return len(released)


def spend_caps_from_settings(settings: Settings, ledger: SpendLedger) -> SpendCaps:
    return SpendCaps(
        ledger,
        fleet=SpendCap(settings.spend_cap_fleet_daily_usd or None,
                       settings.spend_cap_fleet_monthly_usd or None),
        bulk_fraction=settings.spend_cap_bulk_fraction,
        refresh_seconds=settings.spend_cap_refresh_seconds,
        stale_seconds=settings.sweeper_grace_seconds)
