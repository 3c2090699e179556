"""Each tenant's token quota, in front of the fleet's shared token budget.

Each tenant has a token quota of its own (``TenantQuota``, per minute: the tenant's setting
or a fair share of the fleet's), taken before the shared buckets (calmq.calls.budget), so
one tenant's flood waits at its quota and cannot put the bulk bucket into debt for everyone
(docs/explanation/token-budget.md). PostgreSQL keeps the tenants' buckets
(``TenantTokens``; calmq.data.budget.TenantTokenLedger answers).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from calmq.calls.budget import _metrics
from calmq.jobs import Priority

__all__ = ["TenantHold", "TenantQuota", "TenantTokens"]

log = logging.getLogger(__name__)


class TenantTokens(Protocol):
    """Where tenants' token buckets live (calmq.data.budget.TenantTokenLedger)."""

    async def take(self, tenant_id: uuid.UUID, need: float, rate: float, cap: float, *,
                   debt: float = 0.0) -> tuple[bool, float]: ...

    async def give_back(self, tenant_id: uuid.UUID, tokens: float, cap: float) -> None: ...

    async def quotas(self) -> dict[uuid.UUID, int]: ...

    async def active_tenants(self) -> int: ...


@dataclass
class TenantHold:
    """Tokens one call took from its tenant's quota; ``settle`` gives back the unspent."""

    quota: TenantQuota
    tenant_id: uuid.UUID
    tokens: float
    cap: float
    _settled: bool = False

    async def settle(self, charged_tokens: float) -> None:
        if self._settled:
            return
        self._settled = True
        back = self.tokens - charged_tokens
        if abs(back) > 1e-6:
            await self.quota._give_back(self.tenant_id, back, self.cap)


class TenantQuota:
    """Each tenant's tokens per minute, in PostgreSQL, in front of the shared buckets.

    A tenant without a quota of its own gets its fair share: the larger of
    ``default_per_minute`` (the fleet's tokens per minute times ``budget_tenant_share``)
    and an equal part of ``fleet_per_minute`` among the tenants that made calls in the last
    minute (all of it for a tenant alone), read every ``refresh_seconds``. A call waits
    here, before it joins the shared queue, while its tenant is past its quota: the shared
    buckets then serve the other tenants. With the database away the quota is not enforced
    (the shared budget still holds the provider's limit): metering a tenant must not stop
    every tenant's work.

    Interactive calls may take the quota into debt, by at most ``interactive_debt_seconds``
    of it: a tenant's bulk backlog does not hold its interactive work back, and a flood of
    interactive work runs at the tenant's quota (after that much), not at the fleet's.
    """

    def __init__(self, ledger: TenantTokens, default_per_minute: int, *,
                 fleet_per_minute: int = 0, burst_seconds: float = 1.0,
                 refresh_seconds: float = 2.0, queue_seconds: float = 15.0,
                 interactive_debt_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.interactive_debt_seconds = interactive_debt_seconds
        self.share_per_minute = default_per_minute
        self.fleet_per_minute = fleet_per_minute
        self._active = 1
        self.burst_seconds = burst_seconds
        self.refresh_seconds = refresh_seconds
        self.queue_seconds = queue_seconds
        self._clock = clock
        self._own: dict[uuid.UUID, int] = {}
        self._read_at: float | None = None
        self._waiting: dict[uuid.UUID, int] = {}  # calls of a tenant waiting here now
        self._avg_tokens = 0.0  # of a call, moving average

    @property
    def default_per_minute(self) -> int:
        """The quota of a tenant without one of its own, as last read."""
        if self.share_per_minute <= 0:
            return 0
        return max(self.share_per_minute, self.fleet_per_minute // max(1, self._active))

    def allowance(self, tenant_id: uuid.UUID, priority: str = Priority.BULK) -> int | None:
        """How many of the tenant's jobs a worker should hold: what its quota serves within
        ``queue_seconds`` (None: no quota). The worker does not claim more of that tenant's
        jobs (they wait, and are released as the quota allows): claimed, they would hold
        the worker's in-flight room, and the Kafka partitions behind them, from every other
        tenant. Its interactive jobs count against a room of their own
        (calmq.processors.admission.QuotaGate): what the quota serves within its debt bound,
        which is what they can take at once. Smaller than the bulk room, so a tenant alone
        with an interactive flood leaves room for a second tenant's first jobs, whose first
        call is what halves the first tenant's share."""
        per_minute = self._own.get(tenant_id, self.default_per_minute)
        if per_minute <= 0:
            return None
        seconds = self.queue_seconds
        if priority == Priority.INTERACTIVE and self.interactive_debt_seconds > 0:
            seconds = min(seconds, self.interactive_debt_seconds)
        return self.serves(per_minute, seconds)

    def waiting(self, tenant_id: uuid.UUID) -> int:
        """The tenant's calls waiting for its quota in this process now."""
        return self._waiting.get(tenant_id, 0)

    def serves(self, per_minute: int, seconds: float) -> int:
        """How many calls a quota of ``per_minute`` tokens serves in ``seconds`` (at least
        one), from the size of the calls seen so far."""
        tokens = self._avg_tokens or 500.0
        return max(1, math.ceil(per_minute / 60 * seconds / tokens))

    async def per_minute(self, tenant_id: uuid.UUID) -> int:
        now = self._clock()
        if self._read_at is None or now - self._read_at >= self.refresh_seconds:
            try:
                self._own = await self.ledger.quotas()
                if self.fleet_per_minute:
                    self._active = await self.ledger.active_tenants()
            except Exception as exc:  # noqa: BLE001 - keep the last quotas read
                log.warning("reading the tenants' token quotas failed: %s", exc)
            self._read_at = now
        return self._own.get(tenant_id, self.default_per_minute)

    async def acquire(self, tenant: str, tokens: float, priority: str = Priority.BULK
                      ) -> TenantHold | None:
        """Wait until the tenant's quota covers ``tokens``; None: no quota applies.

        An interactive call takes its tokens into debt, up to ``interactive_debt_seconds``
        of the quota, so a tenant's own bulk backlog does not hold its interactive work back
        (the shared buckets still serve interactive first) and the tenant's bulk calls wait
        for the debt; past that bound it waits too, ahead of the tenant's bulk calls."""
        try:
            tenant_id = uuid.UUID(tenant)
        except ValueError:
            return None
        per_minute = await self.per_minute(tenant_id)
        if per_minute <= 0:
            return None
        rate = per_minute / 60
        cap = max(per_minute * self.burst_seconds / 60, 1.0)
        debt = rate * self.interactive_debt_seconds if priority == Priority.INTERACTIVE else 0.0
        self._avg_tokens = tokens if not self._avg_tokens else \
            0.9 * self._avg_tokens + 0.1 * tokens
        waited = False
        self._waiting[tenant_id] = self._waiting.get(tenant_id, 0) + 1
        try:
            while True:
                try:
                    granted, wait = await self.ledger.take(
                        tenant_id, tokens, rate, cap, debt=debt)
                except Exception as exc:  # noqa: BLE001 - fail open, see the class docstring
                    log.warning("the tenant token quota is unavailable: %s", exc)
                    return None
                if granted:
                    return TenantHold(self, tenant_id, tokens, cap)
                if not waited:
                    waited = True
                    _metrics().quota_waits.labels(tenant).inc()
                # At most a second: the tenant's quota may be raised meanwhile.
                await asyncio.sleep(min(max(wait, 0.01), 1.0))  # a refill's pause, not a sync
        finally:
            left = self._waiting.get(tenant_id, 1) - 1
            if left > 0:
                self._waiting[tenant_id] = left
            else:
                self._waiting.pop(tenant_id, None)

    async def _give_back(self, tenant_id: uuid.UUID, tokens: float, cap: float) -> None:
        try:
            await self.ledger.give_back(tenant_id, tokens, cap)
        except Exception as exc:  # noqa: BLE001 - a lost give-back only makes a tenant wait
            log.warning("giving tokens back to a tenant's quota failed: %s", exc)
