"""The fleet-wide token budget, and the metering of every model call (tokens and cost).

The provider's quota is the scarce resource: past it, more workers only produce 429s
faster. The budget holds the whole fleet under the quota (docs/explanation/token-budget.md):

- PostgreSQL keeps one row per provider and model with two token buckets (bulk and
  interactive), for tokens and for requests (migration 0005). ``SharedBuckets`` is what a
  process asks; calmq.data.budget.BudgetLedger answers from those rows.
- Each worker process has one ``TokenBudget`` per model. Its dispatcher task leases short
  slices from the ledger (a few statements a second per worker, not one per call), hands
  them to waiting calls, interactive first, and gives back what was not spent once a slice
  is ``lease_seconds`` old.
- A call reserves its estimate (prompt tokens + max output tokens) and settles with what
  the provider counted; the difference goes back to the fleet.
- A 429 pauses the provider for the whole fleet until its Retry-After.
- A call the provider refused or never received (429, 5xx, 4xx, no connection) gives its
  whole reservation back: it counted nothing. A timeout keeps it (the provider may have
  counted the call).
- Each tenant has a token quota of its own (``TenantQuota``, per minute: the tenant's
  setting or a fair share of the fleet's), taken before the shared buckets, so one tenant's
  flood waits at its quota and cannot put the bulk bucket into debt for everyone.

``BudgetedProvider`` wraps any ``Provider`` with both, so a worker wires it in one line
(calmq.calls.stack's ``open_metered_provider``) and steps keep calling
``provider.complete``.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Gauge, Histogram

from calmq.calls.caching import CacheUse, cache_use, meter_cache
from calmq.calls.gate import ProviderGate, provider_label
from calmq.calls.pricing import ModelPrice, cost_usd
from calmq.calls.wires import (
    ModelReply,
    ModelStream,
    Provider,
    RateLimits,
    Streamer,
    current_clock,
    current_scope,
)
from calmq.data.budget import Grant, Usage, UsageLedger
from calmq.errors import StepFailure
from calmq.failure_codes import BudgetEffect, failure, spec
from calmq.group_commit import GroupCommitter
from calmq.jobs import Priority
from calmq.retrying import RECONNECT, Backoff, Reconnect

if TYPE_CHECKING:
    from calmq.calls.tiers import TierChooser
    from calmq.data import Database

__all__ = [
    "BucketLimits",
    "BudgetedProvider",
    "Grant",
    "Reservation",
    "SharedBuckets",
    "TenantQuota",
    "TokenBudget",
    "UsageRecorder",
    "charged_on_failure",
    "estimate_prompt_tokens",
]

log = logging.getLogger(__name__)

# Pauses of the budget's dispatcher while the ledger is away (it used to be a fixed 0.5 s).
_LEDGER_RETRY = Backoff(initial=0.1, maximum=1.0)

PRIORITIES = (Priority.INTERACTIVE, Priority.BULK)
_RATE_WINDOW = 10.0  # seconds of admissions that give a process's budget rate


# -- metrics (created on first use; labels bounded by models, workflows and tenants) -------


@dataclass(frozen=True)
class _Metrics:
    tokens: Counter
    cost: Counter
    calls: Counter
    wait: Histogram
    leases: Counter
    pauses: Counter
    quota_waits: Counter
    limits: Gauge


@cache
def _metrics() -> _Metrics:
    return _Metrics(
        tokens=Counter("calmq_model_tokens_total", "Tokens the provider reported",
                       ["workflow", "tenant", "provider", "model", "direction"]),
        cost=Counter("calmq_model_cost_usd_total", "Cost of model calls in USD (price table)",
                     ["workflow", "tenant", "provider", "model"]),
        calls=Counter("calmq_model_calls_total", "Model calls by how they ended",
                      ["provider", "model", "outcome"]),
        wait=Histogram("calmq_budget_wait_seconds", "Time a call waited for budget",
                       ["priority"],
                       buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)),
        leases=Counter("calmq_budget_leases_total", "Budget slices asked of the fleet ledger",
                       ["model", "priority", "outcome"]),
        pauses=Counter("calmq_budget_pauses_total", "429s that paused the provider fleet-wide",
                       ["model"]),
        quota_waits=Counter("calmq_tenant_quota_waits_total",
                            "Model calls that waited for their tenant's token quota",
                            ["tenant"]),
        limits=Gauge("calmq_provider_limit_per_minute",
                     "Tokens and requests per minute: the budget as configured, and as the "
                     "provider's rate-limit headers state it",
                     ["provider", "model", "limit", "source"]),
    )


# -- limits and the ledger --------------------------------------------------------------


@dataclass(frozen=True)
class BucketLimits:
    """The provider's limits and how the buckets follow them.

    Providers count a sliding minute. Over any minute the fleet may spend a full bucket plus
    a minute and a lease of refill, so the refill rate is set below the limit by exactly
    that much: ``cap + rate * (60 + lease) <= limit``. Each bucket holds at least one
    request, or the interactive share could never hold a whole call.
    """

    tokens_per_minute: int
    requests_per_minute: int
    interactive_share: float = 0.2
    burst_seconds: float = 1.0
    lease_seconds: float = 0.5

    def _cap(self, per_minute: int, floor: float) -> float:
        return max(per_minute * self.burst_seconds / 60, floor)

    def _rate(self, per_minute: int, cap: float) -> float:
        if per_minute == 0:
            return 0.0
        factor = (per_minute - cap) / (per_minute * (60 + self.lease_seconds) / 60)
        return per_minute / 60 * max(0.5, factor)

    @property
    def request_cap(self) -> float:
        if self.requests_per_minute == 0:
            return 0.0
        share = self.interactive_share
        floor = max(1 / share if share > 0 else 1.0, 1 / (1 - share))
        return self._cap(self.requests_per_minute, floor)

    @property
    def token_cap(self) -> float:
        return self._cap(self.tokens_per_minute, 0.0)

    @property
    def request_rate(self) -> float:
        return self._rate(self.requests_per_minute, self.request_cap)

    @property
    def token_rate(self) -> float:
        return self._rate(self.tokens_per_minute, self.token_cap)


class SharedBuckets(Protocol):
    """Where the fleet's buckets live (calmq.data.budget.BudgetLedger: PostgreSQL)."""

    async def configure(self, provider: str, model: str, limits: BucketLimits) -> None: ...

    async def take(
        self, provider: str, model: str, priority: str, *, need_tokens: float,
        want_tokens: float, want_requests: float,
    ) -> Grant: ...

    async def give_back(
        self, provider: str, model: str, priority: str, tokens: float, requests: float
    ) -> None: ...

    async def pause(self, provider: str, model: str, seconds: float) -> None: ...


# -- the per-process budget -------------------------------------------------------------


@dataclass
class _Slice:
    priority: str
    tokens: float
    requests: float
    expires: float


@dataclass(order=True)
class _Waiter:
    rank: int  # 0 interactive, 1 bulk: the heap serves interactive first
    seq: int
    tokens: float = field(compare=False)
    priority: str = field(compare=False)
    future: asyncio.Future[str] = field(compare=False)


@dataclass
class Reservation:
    """Budget held by one call; ``settle`` once the provider said what it counted."""

    budget: TokenBudget
    source: str
    tokens: float
    waited: float
    _settled: bool = False

    def settle(self, charged_tokens: float) -> None:
        if not self._settled:
            self._settled = True
            self.budget._settle(self.source, self.tokens - charged_tokens)


class TokenBudget:
    """One process's share of the fleet budget for one provider and model."""

    def __init__(
        self,
        ledger: SharedBuckets,
        provider: str,
        model: str,
        limits: BucketLimits,
        *,
        slice_seconds: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.provider = provider
        self.model = model
        self.limits = limits
        self._clock = clock
        self._slice_seconds = slice_seconds
        self._slice_tokens = limits.token_rate * slice_seconds
        self._slice_requests = max(1.0, math.floor(limits.request_rate * slice_seconds))
        self._slices: list[_Slice] = []
        self._owed: dict[str, float] = dict.fromkeys(PRIORITIES, 0.0)  # settlements to give back
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._owed_due: float | None = None
        self._paused_until = 0.0
        self._admitted: deque[float] = deque()  # admission times over the last _RATE_WINDOW
        self._avg_tokens = 0.0  # of a call, moving average
        self._backlog_since: float | None = None  # calls have waited without a break since
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.ledger.configure(self.provider, self.model, self.limits)
        self._task = asyncio.create_task(self._dispatch(), name=f"budget-{self.model}")

    async def lower_to(self, tokens_per_minute: int | None,
                       requests_per_minute: int | None) -> bool:
        """Bring the limits down to what the provider states (never up: a configured budget
        below the provider's quota is the operator's choice); True when they changed. The
        fleet's bucket row is configured anew, so every worker follows."""
        tpm, rpm = self.limits.tokens_per_minute, self.limits.requests_per_minute
        new_tpm = min(tpm, tokens_per_minute) if tpm and tokens_per_minute else tpm
        new_rpm = min(rpm, requests_per_minute) if rpm and requests_per_minute else rpm
        if (new_tpm, new_rpm) == (tpm, rpm):
            return False
        log.warning("the provider states %s tokens and %s requests per minute for %s; the "
                    "budget (%d, %d) is brought down to them", tokens_per_minute,
                    requests_per_minute, self.model, tpm, rpm)
        self.limits = BucketLimits(new_tpm, new_rpm, self.limits.interactive_share,
                                   self.limits.burst_seconds, self.limits.lease_seconds)
        self._slice_tokens = self.limits.token_rate * self._slice_seconds
        self._slice_requests = max(1.0, math.floor(self.limits.request_rate
                                                   * self._slice_seconds))
        await self.ledger.configure(self.provider, self.model, self.limits)
        return True

    async def close(self) -> None:
        """Stop handing out budget and give back every unspent slice."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for waiter in self._queue:
            waiter.future.cancel()
        self._queue.clear()
        with contextlib.suppress(Exception):
            await self._give_back(expired_only=False)

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._queue if not w.future.done())

    async def acquire(self, tokens: float, priority: str) -> Reservation:
        """Wait until the fleet can afford ``tokens`` and one request for this priority."""
        if self._task is None:
            raise RuntimeError("TokenBudget.start() was not awaited")
        started = self._clock()
        waiter = _Waiter(0 if priority == Priority.INTERACTIVE else 1, next(self._seq), tokens,
                         priority, asyncio.get_running_loop().create_future())
        if self._backlog_since is None:
            self._backlog_since = started
        heapq.heappush(self._queue, waiter)
        self._wake.set()
        source = await waiter.future
        now = self._clock()
        waited = now - started
        self._admitted.append(now)
        self._avg_tokens = tokens if not self._avg_tokens else \
            0.9 * self._avg_tokens + 0.1 * tokens
        _metrics().wait.labels(priority).observe(waited)
        return Reservation(self, source, tokens, waited)

    def calls_per_second(self) -> float | None:
        """How fast this process gets budget.

        Measured only while calls have been waiting for budget for a while: then the rate is
        what the budget gives this process. Otherwise the process is not held back by the
        budget and what it measures is its own demand, so the answer is the whole fleet's
        rate (an upper bound: other workers share it).
        """
        now = self._clock()
        while self._admitted and self._admitted[0] < now - _RATE_WINDOW:
            self._admitted.popleft()
        since = self._backlog_since
        if since is not None and now - since >= _RATE_WINDOW / 2:
            span = min(_RATE_WINDOW, now - since)
            return sum(1 for t in self._admitted if t >= now - span) / span
        rates = []
        if self.limits.requests_per_minute:
            rates.append(self.limits.request_rate)
        if self.limits.tokens_per_minute and self._avg_tokens:
            rates.append(self.limits.token_rate / self._avg_tokens)
        return min(rates) if rates else None

    def pause(self, seconds: float) -> bool:
        """Stop this process at once; True when the fleet has to be told (not paused yet)."""
        until = self._clock() + seconds
        if until <= self._paused_until:
            return False
        self._paused_until = until
        # The provider just said its window is full: what we hold would only meet more 429s.
        self._slices.clear()
        self._wake.set()
        return True

    def resume(self) -> None:
        """End a pause now (`calmq provider unpause` lifted the fleet's)."""
        self._paused_until = 0.0
        self._wake.set()

    async def pause_fleet(self, seconds: float) -> None:
        if self.pause(seconds):
            _metrics().pauses.labels(self.model).inc()
            await self.ledger.pause(self.provider, self.model, seconds)

    def _settle(self, source: str, delta: float) -> None:
        if self._owed_due is None:
            self._owed_due = self._clock() + self.limits.lease_seconds / 2
        self._owed[source] += delta

    # -- dispatcher ----------------------------------------------------------------

    def _take_local(self, waiter: _Waiter) -> str | None:
        usable = [s for s in self._slices
                  if s.priority in (waiter.priority, Priority.BULK)]
        # Interactive spends its own slices first; oldest first within a priority.
        usable.sort(key=lambda s: (s.priority != waiter.priority, s.expires))
        limit_tokens = self.limits.tokens_per_minute > 0
        limit_requests = self.limits.requests_per_minute > 0
        if limit_tokens and sum(s.tokens for s in usable) < waiter.tokens:
            return None
        if limit_requests and sum(s.requests for s in usable) < 1:
            return None
        need_t, need_r = waiter.tokens, 1.0
        source = waiter.priority
        for s in usable:
            if need_t <= 0 and need_r <= 0:
                break
            take_t = min(s.tokens, need_t) if limit_tokens else 0.0
            take_r = min(s.requests, need_r) if limit_requests else 0.0
            if take_t > 0 or take_r > 0:
                source = s.priority
            s.tokens -= take_t
            s.requests -= take_r
            need_t -= take_t
            need_r -= take_r
        self._slices = [s for s in self._slices
                        if (limit_tokens and s.tokens > 1e-9)
                        or (limit_requests and s.requests > 1e-9)]
        return source

    def _demand(self, priority: str) -> tuple[float, int]:
        live = [w for w in self._queue if w.priority == priority and not w.future.done()]
        return sum(w.tokens for w in live), len(live)

    async def _give_back(self, *, expired_only: bool = True) -> None:
        now = self._clock()
        back: dict[str, list[float]] = {p: [self._owed[p], 0.0] for p in PRIORITIES}
        keep: list[_Slice] = []
        for s in self._slices:
            if expired_only and s.expires > now:
                keep.append(s)
                continue
            back[s.priority][0] += s.tokens if self.limits.tokens_per_minute else 0.0
            back[s.priority][1] += s.requests if self.limits.requests_per_minute else 0.0
        self._slices = keep
        self._owed_due = None
        for priority, (tokens, requests) in back.items():
            self._owed[priority] = 0.0
            if abs(tokens) > 1e-6 or abs(requests) > 1e-6:
                await self.ledger.give_back(self.provider, self.model, priority, tokens, requests)

    def _next_expiry(self) -> float | None:
        due = [s.expires for s in self._slices]
        if self._owed_due is not None:
            due.append(self._owed_due)
        return min(due, default=None)

    async def _dispatch(self) -> None:
        # The database is away: keep the waiters and try again soon (at most a second: a
        # call waits on this), jittered so that the fleet's workers do not ask in lockstep.
        reconnect = Reconnect("a token budget ledger call failed", _LEDGER_RETRY)
        while True:
            try:
                await self._dispatch_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any ledger failure: keep the waiters
                await asyncio.sleep(reconnect.failed(exc))  # an outage's pause, not a sync
            else:
                reconnect.succeeded()

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake early when a new call arrived since this round of the dispatcher
        began (it may be interactive). The wake-up is cleared where the round starts looking
        at the queue, not here: a call that arrived while the round awaited the ledger (a
        bulk lease that came back empty) would otherwise sleep out the bulk's pause."""
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that
        # arrives as the event is set, and close() would then wait for ever.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, seconds)):
                await self._wake.wait()

    async def _dispatch_once(self) -> None:
        self._wake.clear()  # a call that arrives from here on ends this round's sleep
        now = self._clock()
        expiry = self._next_expiry()
        if expiry is not None and expiry <= now:
            await self._give_back()
        while self._queue and self._queue[0].future.done():  # cancelled (step timeout)
            heapq.heappop(self._queue)
        if not self._queue:
            self._backlog_since = None
            expiry = self._next_expiry()
            await self._sleep(expiry - now if expiry is not None else 3600.0)
            return
        if self._paused_until > now:
            await self._sleep(self._paused_until - now)
            return
        head = self._queue[0]
        source = self._take_local(head)
        if source is not None:
            heapq.heappop(self._queue)
            head.future.set_result(source)
            if not self._queue:
                self._backlog_since = None
            return
        demand_tokens, demand_calls = self._demand(head.priority)
        # What this process holds already counts: ask the fleet only for the rest.
        held = sum(s.tokens for s in self._slices if s.priority in (head.priority, Priority.BULK))
        need = max(0.0, head.tokens - held)  # 0: short of a request only
        want_tokens = max(need, min(self._slice_tokens, demand_tokens - held))
        want_requests = max(1.0, min(self._slice_requests, float(demand_calls)))
        grant = await self.ledger.take(self.provider, self.model, head.priority,
                                       need_tokens=need, want_tokens=want_tokens,
                                       want_requests=want_requests)
        metrics = _metrics().leases
        if grant.tokens > 0 or grant.requests > 0:
            metrics.labels(self.model, head.priority, "granted").inc()
            self._slices.append(_Slice(head.priority, grant.tokens, grant.requests,
                                       self._clock() + self.limits.lease_seconds))
            return
        metrics.labels(self.model, head.priority, "empty").inc()
        # A fleet-wide pause another worker started shows up here as a long wait; it is
        # capped so that an interactive call arriving meanwhile is not kept behind it.
        await self._sleep(min(max(grant.wait_seconds, 0.002), 0.25))


# -- each tenant's token quota ---------------------------------------------------------


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


# -- usage: tokens and cost per attempt and per job ---------------------------------------


class UsageRecorder:
    """Writes model calls' tokens and cost to their attempt and job, group-committed.

    For calls made outside a step runner's attempt (the runner carries its attempts' usage
    into the outcome's own transaction), and for an attempt stopped before its outcome was
    written. ``record`` returns once the row is written.
    """

    def __init__(self, db: Database, *, window: float = 0.005) -> None:
        self._usage = UsageLedger(db)
        # One writer: usage rows of one job would contend; retried while the database is
        # away, since an attempt's tokens are spent whether or not they are written.
        self._batcher: GroupCommitter[Usage] = GroupCommitter(
            "usage-recorder", self._usage.add, window=window, max_batch=500, retry=RECONNECT)

    def start(self) -> None:
        self._batcher.start()

    async def close(self) -> None:
        await self._batcher.close(grace=5.0)

    async def record(self, job_id: str, input_tokens: int, output_tokens: int,
                     cost: float, calls: int = 1, *, cache: CacheUse | None = None) -> None:
        try:
            job = uuid.UUID(job_id)
        except ValueError:
            return  # not a calmq job (a hand-made call): nothing to add it to
        # A step cancelled meanwhile (timeout) still has its usage written: the batcher
        # shields the write from its caller.
        cache = cache or CacheUse()
        await self._batcher.submit(Usage(job, input_tokens, output_tokens, cost, calls,
                                         cache.read, cache.written, cache.saved_usd))


# -- the provider wrapper -----------------------------------------------------------------


def estimate_prompt_tokens(messages: list[dict[str, str]]) -> int:
    """About four characters a token, as providers estimate before they tokenize."""
    chars = sum(len(m.get("content") or "") for m in messages)
    return max(1, (chars + 3) // 4)


@dataclass
class _Taken:
    """What one call holds: its shared-budget reservation and its tenant-quota hold."""

    reservation: Reservation | None
    hold: TenantHold | None

    async def settle(self, charged_tokens: float) -> None:
        if self.reservation is not None:
            self.reservation.settle(charged_tokens)
        if self.hold is not None:
            # Shielded: a call cancelled at its timeout still gives its quota back.
            await asyncio.shield(self.hold.settle(charged_tokens))


class BudgetedProvider:
    """A ``Provider`` that waits for the fleet budget, meters usage and cost, and turns a 429
    into a fleet-wide pause. Either part may be absent (no budget configured: metering only).
    """

    def __init__(
        self,
        inner: Provider,
        *,
        provider: str,
        model: str,
        budget: TokenBudget | None = None,
        usage: UsageRecorder | None = None,
        prices: Mapping[str, ModelPrice] | None = None,
        counts_max_tokens: bool = True,
        default_pause_seconds: float = 1.0,
        quota: TenantQuota | None = None,
        gate: ProviderGate | None = None,
        learn_limits: Callable[[RateLimits], Awaitable[TokenBudget | None]] | None = None,
        embedder: BudgetedProvider | None = None,
        prices_table: bool = True,
        tiers: TierChooser | None = None,
    ) -> None:
        self.inner = inner
        # The service tier of each call, from the time its job has left (calmq.calls.tiers).
        self.tiers = tiers
        self.quota = quota
        # Blocks and rate-limit pauses, fleet-wide (calmq.calls.gate).
        self.gate = gate
        if gate is not None:  # a pause lifted early is lifted in the budget too
            gate.on_unpaused = self._unpaused
        # Makes a budget from the limits the provider states when none was configured.
        self._learn_limits = learn_limits
        self._learning: asyncio.Task[None] | None = None
        # The embeddings provider, when it is not this one (CALMQ_EMBEDDINGS_*).
        self.embedder = embedder
        self.observed = RateLimits()
        self.owns_usage = True  # False: the usage recorder is shared with another wrapper
        if hasattr(inner, "observer"):
            inner.observer = self._observe
        self.provider = provider
        self.model = model
        self.budget = budget
        self.usage = usage
        self.prices = dict(prices or {})
        self.prices_table = prices_table
        self.counts_max_tokens = counts_max_tokens
        self.default_pause_seconds = default_pause_seconds
        self._in_call = 0  # admitted by the budget, waiting for the provider's answer

    def _unpaused(self) -> None:
        if self.budget is not None:
            self.budget.resume()

    def in_flight_limit(self, queue_seconds: float) -> int | None:
        """How many jobs this worker should hold: those in a model call now, plus what its
        share of the budget serves within ``queue_seconds``. A worker that claimed more
        would keep them waiting for budget past their step timeout, while other workers
        (or later polls) could run them; None without a budget or before any estimate.
        """
        if self.budget is None:
            return None
        rate = self.budget.calls_per_second()
        if rate is None:
            return None
        return self._in_call + math.ceil(rate * queue_seconds) + 1

    async def complete(
        self,
        *,
        messages: list[dict[str, str]],
        job_id: str,
        max_tokens: int,
        response_schema: dict[str, Any] | None = None,
        wait_for_cooldown: bool = True,
    ) -> ModelReply:
        scope = current_scope()
        estimate = estimate_prompt_tokens(messages) + max_tokens
        if self.gate is not None:
            # blocked: refused here; paused: waits retry-after (or, for a step with another
            # allowed model, refused: calmq.calls.fallback)
            await self.gate.admit(wait=wait_for_cooldown)
        taken = await self._take(scope.tenant_id, estimate, scope.priority)
        calls = _metrics().calls
        self._in_call += 1
        try:
            def send() -> Awaitable[ModelReply]:
                return self.inner.complete(messages=messages, job_id=job_id,
                                           max_tokens=max_tokens,
                                           response_schema=response_schema)

            # At the chosen tier; a flex call refused or late is sent again at the standard
            # tier inside this call, under the same reservation (calmq.calls.tiers).
            reply = await (send() if self.tiers is None else self.tiers.call(send, scope))
        except StepFailure as exc:
            replacement = await self._failed_call(exc, taken, estimate)
            if replacement is exc:
                raise
            raise replacement from exc
        except BaseException as exc:
            await self._failed_call(exc, taken, estimate)
            raise
        finally:
            self._in_call -= 1
        calls.labels(self.provider, self.model, "ok").inc()
        await self._answered(reply, taken, estimate, max_tokens, job_id)
        return reply

    async def _answered(self, reply: ModelReply, taken: _Taken, estimate: int,
                        max_tokens: int, job_id: str) -> None:
        """Settle an answered call with the usage the provider reported, and meter it."""
        scope = current_scope()
        output = max(max_tokens, reply.output_tokens) if self.counts_max_tokens \
            else reply.output_tokens
        await taken.settle((reply.input_tokens or estimate - max_tokens) + output)
        await self._meter(job_id, scope.workflow, scope.tenant_id, reply.input_tokens,
                          reply.output_tokens, cached=reply.cached_input_tokens,
                          tier=reply.service_tier, written=reply.cache_write_tokens)

    def stream(
        self,
        *,
        messages: list[dict[str, str]],
        job_id: str,
        max_tokens: int,
        response_schema: dict[str, Any] | None = None,
        wait_for_cooldown: bool = True,
    ) -> ModelStream:
        """A streamed call under the same gate, budget and meter as ``complete``: admitted
        and reserved before it is sent, settled with the usage the stream reported at its
        end (a stream that broke off keeps its estimate: the provider counted what it
        wrote)."""
        inner = self.inner
        if not isinstance(inner, Streamer):
            raise failure("not_supported", f"provider {self.provider} cannot stream")

        async def source(out: ModelStream) -> AsyncIterator[str]:
            scope = current_scope()
            estimate = estimate_prompt_tokens(messages) + max_tokens
            if self.gate is not None:
                await self.gate.admit(wait=wait_for_cooldown)
            taken = await self._take(scope.tenant_id, estimate, scope.priority)
            self._in_call += 1
            streamed = inner.stream(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                    response_schema=response_schema)
            try:
                async for text in streamed:
                    yield text
                reply = await streamed.final()
            except StepFailure as exc:
                replacement = await self._failed_call(exc, taken, estimate)
                if replacement is exc:
                    raise
                raise replacement from exc
            except BaseException as exc:  # cancelled, or the reader stopped early
                await streamed.aclose()
                await self._failed_call(exc, taken, estimate)
                raise
            finally:
                self._in_call -= 1
            _metrics().calls.labels(self.provider, self.model, "ok").inc()
            await self._answered(reply, taken, estimate, max_tokens, job_id)
            out.reply = reply

        return ModelStream(source)

    async def embed(self, *, inputs: list[str], job_id: str) -> Any:
        """Embeddings through the same budget and meter (when the inner provider embeds),
        or through the embeddings provider's own (``embedder``)."""
        if self.embedder is not None:
            return await self.embedder.embed(inputs=inputs, job_id=job_id)
        inner_embed = getattr(self.inner, "embed", None)
        if inner_embed is None:
            raise failure("not_supported", f"provider {self.provider} cannot embed")
        scope = current_scope()
        estimate = max(1, sum(len(t) for t in inputs) // 4)
        if self.gate is not None:
            await self.gate.admit()
        taken = await self._take(scope.tenant_id, estimate, scope.priority)
        try:
            reply = await inner_embed(inputs=inputs, job_id=job_id)
        except StepFailure as exc:
            replacement = await self._failed_call(exc, taken, estimate)
            if replacement is exc:
                raise
            raise replacement from exc
        except BaseException as exc:
            await self._failed_call(exc, taken, estimate)
            raise
        _metrics().calls.labels(self.provider, self.model, "ok").inc()
        used = int(getattr(reply, "input_tokens", 0) or 0)
        await taken.settle(used or estimate)
        await self._meter(job_id, scope.workflow, scope.tenant_id, used, 0)
        return reply

    async def _take(self, tenant: str, estimate: float, priority: str) -> _Taken:
        """A call's tokens from its tenant's quota, then from the shared budget; what the
        quota gave is given back if the budget wait ends otherwise (cancelled, timed out)."""
        hold = (await self.quota.acquire(tenant, estimate, priority)
                if self.quota is not None else None)
        try:
            reservation = (await self.budget.acquire(estimate, priority)
                           if self.budget is not None else None)
        except BaseException:
            if hold is not None:
                await asyncio.shield(hold.settle(0))
            raise
        return _Taken(reservation, hold)

    async def _failed_call(self, exc: BaseException, taken: _Taken,
                           estimate: float) -> BaseException:
        """Settle a failed call; returns what to raise (a blocked provider's refusal in
        place of its 401/403/404/quota answer)."""
        await taken.settle(charged_on_failure(exc, estimate))
        if isinstance(exc, StepFailure):
            return await self._failed(exc)
        return exc

    async def _failed(self, failure: StepFailure) -> StepFailure:
        _metrics().calls.labels(self.provider, self.model, failure.code).inc()
        if failure.code == "rate_limited":
            seconds = (failure.retry_after if failure.retry_after is not None
                       else self.default_pause_seconds)
            if self.budget is not None:
                await self.budget.pause_fleet(seconds)
            if self.gate is not None:
                await self.gate.pause(seconds)
            return failure
        if self.gate is not None:
            return await self.gate.failed(failure)
        return failure

    def _observe(self, status: int, limits: RateLimits) -> None:
        """Every answer's rate-limit headers: the limits the provider states, shown beside
        the configured ones; a budget above them is brought down, a budget left unset is
        made from them (``learn_limits``)."""
        if not limits.stated:
            return
        first = not self.observed.stated
        changed = (limits.tokens_per_minute, limits.requests_per_minute) != (
            self.observed.tokens_per_minute, self.observed.requests_per_minute)
        self.observed = limits
        if not changed:
            return
        gauge = _metrics().limits
        label = provider_label(self.provider)
        for name, value in (("tokens_per_minute", limits.tokens_per_minute),
                            ("requests_per_minute", limits.requests_per_minute)):
            if value is not None:
                gauge.labels(label, self.model, name, "observed").set(value)
        if self._learning is None or self._learning.done():
            self._learning = asyncio.get_running_loop().create_task(
                self._learn(limits, first))

    async def _learn(self, limits: RateLimits, first: bool) -> None:
        try:
            if self.budget is not None:
                await self.budget.lower_to(limits.tokens_per_minute,
                                           limits.requests_per_minute)
            elif self._learn_limits is not None:
                self.budget = await self._learn_limits(limits)
            if self.budget is not None:
                self.show_configured()
            if self.gate is not None and self.gate.ledger is not None:
                await self.gate.ledger.observe(self.gate.provider, self.model,
                                               limits.tokens_per_minute,
                                               limits.requests_per_minute)
        except Exception as exc:  # noqa: BLE001 - learning a limit must never fail a call
            log.warning("learning the provider's stated limits failed: %s", exc)

    def show_configured(self) -> None:
        if self.budget is None:
            return
        gauge = _metrics().limits
        label = provider_label(self.provider)
        gauge.labels(label, self.model, "tokens_per_minute", "configured").set(
            self.budget.limits.tokens_per_minute)
        gauge.labels(label, self.model, "requests_per_minute", "configured").set(
            self.budget.limits.requests_per_minute)

    async def _meter(self, job_id: str, workflow: str, tenant: str, input_tokens: int,
                     output_tokens: int, *, cached: int = 0, tier: str | None = None,
                     written: int = 0) -> None:
        def price(read: int, wrote: int) -> float:
            return cost_usd(self.prices, self.provider, self.model, input_tokens,
                            output_tokens, cached_input_tokens=read, cache_write_tokens=wrote,
                            service_tier=tier, table=self.prices_table)

        cost = price(cached, written)
        cache = cache_use(price, cached, written)  # read and written, and what it saved
        meter_cache((workflow, tenant, self.provider, self.model), cache)
        m = _metrics()
        m.tokens.labels(workflow, tenant, self.provider, self.model, "input").inc(input_tokens)
        m.tokens.labels(workflow, tenant, self.provider, self.model, "output").inc(output_tokens)
        m.cost.labels(workflow, tenant, self.provider, self.model).inc(cost)
        clock = current_clock()
        if clock is not None:
            # Inside a step runner's attempt: written with its outcome, in one transaction.
            clock.add_usage(input_tokens, output_tokens, cost, self.model, cache)
        elif self.usage is not None:
            await self.usage.record(job_id, input_tokens, output_tokens, cost, cache=cache)

    async def close(self) -> None:
        if self._learning is not None:
            self._learning.cancel()
        if self.gate is not None:
            await self.gate.close()
        if self.embedder is not None:
            await self.embedder.close()
        if self.budget is not None:
            await self.budget.close()
        if self.usage is not None and self.owns_usage:
            await self.usage.close()
        await self.inner.close()


def charged_on_failure(exc: BaseException, estimate: float) -> float:
    """What a failed call cost the quota, as its code's budget effect says
    (calmq.failure_codes): nothing when the provider refused it or never got it (refund, and
    a pause: refused too); the whole estimate when it may have counted it (a timeout, a
    garbled answer, a step cancelled mid-call)."""
    if isinstance(exc, StepFailure) and spec(exc.code, exc.failure_class).budget in (
            BudgetEffect.REFUND, BudgetEffect.PAUSE):
        return 0.0
    return estimate
