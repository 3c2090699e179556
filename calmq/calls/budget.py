"""The fleet-wide token budget: every model call's tokens and requests, held under the quota.

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
  the provider counted; the difference goes back to the fleet (the estimate and what a
  failed call cost: calmq.calls.meter).
- A 429 pauses the provider for the whole fleet until its Retry-After.
- Each tenant has a token quota of its own (calmq.calls.quota), taken before the shared
  buckets.

``BudgetedProvider`` (calmq.calls.budgeted_provider) wraps any ``Provider`` with the budget,
the quota and the meter; ``_metrics`` below holds the metrics of all four.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram

from calmq.data.budget import Grant
from calmq.jobs import Priority
from calmq.retrying import Backoff, Reconnect

__all__ = [
    "BucketLimits",
    "Grant",
    "Reservation",
    "SharedBuckets",
    "TokenBudget",
]

log = logging.getLogger(__name__)

# Pauses of the budget's dispatcher while the ledger is away (it used to be a fixed 0.5 s).
_LEDGER_RETRY = Backoff(initial=0.1, maximum=1.0)

PRIORITIES = (Priority.INTERACTIVE, Priority.BULK)
_RATE_WINDOW = 10.0  # seconds of admissions that give a process's budget rate
_BULK_PAUSE = 0.05  # the least a bulk queue waits after the ledger had nothing for it


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
        # A queue, a wake-up and a dispatcher per priority: an interactive call that the
        # process's slices cannot serve asks the ledger at once, not after the bulk
        # dispatcher's round trip in flight (under a bulk flood its wait was two ledger
        # round trips, 30 ms on average and 250 ms at p99 on a loaded host: bench priority).
        self._queues: dict[str, list[_Waiter]] = {p: [] for p in PRIORITIES}
        self._seq = itertools.count()
        self._wakes: dict[str, asyncio.Event] = {p: asyncio.Event() for p in PRIORITIES}
        self._owed_due: float | None = None
        self._paused_until = 0.0
        self._admitted: deque[float] = deque()  # admission times over the last _RATE_WINDOW
        self._avg_tokens = 0.0  # of a call, moving average
        self._backlog_since: float | None = None  # calls have waited without a break since
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.ledger.configure(self.provider, self.model, self.limits)
        self._tasks = [asyncio.create_task(self._dispatch(p), name=f"budget-{self.model}-{p}")
                       for p in PRIORITIES]

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
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for queue in self._queues.values():
            for waiter in queue:
                waiter.future.cancel()
            queue.clear()
        with contextlib.suppress(Exception):
            await self._give_back(expired_only=False)

    @property
    def waiting(self) -> int:
        return sum(1 for q in self._queues.values() for w in q if not w.future.done())

    async def acquire(self, tokens: float, priority: str) -> Reservation:
        """Wait until the fleet can afford ``tokens`` and one request for this priority."""
        if not self._tasks:
            raise RuntimeError("TokenBudget.start() was not awaited")
        started = self._clock()
        waiter = _Waiter(0 if priority == Priority.INTERACTIVE else 1, next(self._seq), tokens,
                         priority, asyncio.get_running_loop().create_future())
        queue = self._queues[priority]
        # Served at once from what this process holds when no call of its priority waits
        # before it (no turn of the dispatcher: a call that can be paid is not queued).
        behind = any(not w.future.done() for w in queue)
        source = None
        if self._paused_until <= started and not behind:
            source = self._take_local(waiter)
        if source is None:
            if self._backlog_since is None:
                self._backlog_since = started
            heapq.heappush(queue, waiter)
            if not behind:
                # A call behind others changes nothing the dispatcher waits on (its head is
                # still short): waking it for each would ask the ledger once per arrival.
                self._wakes[priority].set()
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
        self._wake_all()
        return True

    def resume(self) -> None:
        """End a pause now (`calmq provider unpause` lifted the fleet's)."""
        self._paused_until = 0.0
        self._wake_all()

    def _wake_all(self) -> None:
        for wake in self._wakes.values():
            wake.set()

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
        live = [w for w in self._queues[priority] if not w.future.done()]
        return sum(w.tokens for w in live), len(live)

    async def _give_back(self, *, expired_only: bool = True) -> None:
        now = self._clock()
        back: dict[str, list[float]] = {p: [self._owed[p], 0.0] for p in PRIORITIES}
        # Taken in the same step as read: a settlement during the awaits below (or the other
        # priority's dispatcher giving back meanwhile) is kept for the next give-back.
        self._owed = dict.fromkeys(PRIORITIES, 0.0)
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
            if abs(tokens) > 1e-6 or abs(requests) > 1e-6:
                await self.ledger.give_back(self.provider, self.model, priority, tokens, requests)

    def _next_expiry(self) -> float | None:
        due = [s.expires for s in self._slices]
        if self._owed_due is not None:
            due.append(self._owed_due)
        return min(due, default=None)

    async def _dispatch(self, priority: str) -> None:
        # The database is away: keep the waiters and try again soon (at most a second: a
        # call waits on this), jittered so that the fleet's workers do not ask in lockstep.
        reconnect = Reconnect("a token budget ledger call failed", _LEDGER_RETRY)
        while True:
            try:
                await self._dispatch_once(priority)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any ledger failure: keep the waiters
                await asyncio.sleep(reconnect.failed(exc))  # an outage's pause, not a sync
            else:
                reconnect.succeeded()

    async def _sleep(self, wake: asyncio.Event, seconds: float) -> None:
        """Sleep, but wake early when a new call arrived since this round of the dispatcher
        began (it may be interactive). The wake-up is cleared where the round starts looking
        at the queue, not here: a call that arrived while the round awaited the ledger (a
        bulk lease that came back empty) would otherwise sleep out the bulk's pause."""
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that
        # arrives as the event is set, and close() would then wait for ever.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, seconds)):
                await wake.wait()

    async def _dispatch_once(self, priority: str) -> None:
        wake, queue = self._wakes[priority], self._queues[priority]
        wake.clear()  # a call that arrives from here on ends this round's sleep
        now = self._clock()
        expiry = self._next_expiry()
        if expiry is not None and expiry <= now:
            await self._give_back()
        while queue and queue[0].future.done():  # cancelled (step timeout)
            heapq.heappop(queue)
        if not queue:
            if not any(self._queues.values()):
                self._backlog_since = None
            expiry = self._next_expiry()
            await self._sleep(wake, expiry - now if expiry is not None else 3600.0)
            return
        if self._paused_until > now:
            await self._sleep(wake, self._paused_until - now)
            return
        head = queue[0]
        source = self._take_local(head)
        if source is not None:
            heapq.heappop(queue)
            head.future.set_result(source)
            if not any(self._queues.values()):
                self._backlog_since = None
            return
        grant = await self._ask_ledger(head)
        metrics = _metrics().leases
        if grant.tokens > 0 or grant.requests > 0:
            metrics.labels(self.model, priority, "granted").inc()
            self._slices.append(_Slice(priority, grant.tokens, grant.requests,
                                       self._clock() + self.limits.lease_seconds))
            return
        metrics.labels(self.model, priority, "empty").inc()
        # A fleet-wide pause another worker started shows up here as a long wait; it is
        # capped so that a call arriving meanwhile is not kept behind it for long. Bulk
        # waits at least _BULK_PAUSE: the ledger's wait is the time to one more call, so a
        # queue held at the quota asked the fleet's bucket row about twice per call, a
        # round trip each (9 % of a worker's CPU under a bulk flood, bench priority); the
        # bucket keeps what refills meanwhile, so the next grant is a few calls' worth.
        least = 0.002 if priority == Priority.INTERACTIVE else _BULK_PAUSE
        await self._sleep(wake, min(max(grant.wait_seconds, least), 0.25))

    async def _ask_ledger(self, head: _Waiter) -> Grant:
        """A slice for the head of a priority's queue, sized by the calls queued behind it.
        Interactive asks for its share of a slice even when one call waits: the next ones
        are then served from the process's slices (what is left goes back at the slice's
        expiry), so a trickle of interactive calls does not pay a round trip each."""
        demand_tokens, demand_calls = self._demand(head.priority)
        if head.priority == Priority.INTERACTIVE:
            ahead = math.ceil(self._slice_requests * self.limits.interactive_share)
            if ahead > demand_calls:
                demand_tokens += (ahead - demand_calls) * (self._avg_tokens or head.tokens)
                demand_calls = ahead
        # What this process holds already counts: ask the fleet only for the rest.
        held = sum(s.tokens for s in self._slices if s.priority in (head.priority, Priority.BULK))
        need = max(0.0, head.tokens - held)  # 0: short of a request only
        want_tokens = max(need, min(self._slice_tokens, demand_tokens - held))
        want_requests = max(1.0, min(self._slice_requests, float(demand_calls)))
        return await self.ledger.take(self.provider, self.model, head.priority,
                                      need_tokens=need, want_tokens=want_tokens,
                                      want_requests=want_requests)
