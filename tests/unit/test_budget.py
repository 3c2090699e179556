"""The per-process token budget and the metering provider, against an in-memory ledger."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from calmq.calls.budget import BucketLimits, Grant, TokenBudget
from calmq.calls.budgeted_provider import BudgetedProvider
from calmq.calls.meter import estimate_prompt_tokens
from calmq.calls.pricing import ModelPrice, cost_usd
from calmq.calls.wires import CallScope, ModelReply, enter_scope
from calmq.errors import FailureClass, StepFailure
from tests.support.scripted import ScriptedProvider


class MemoryLedger:
    """A ledger with one pool per priority that only grows when a test adds to it."""

    def __init__(self, tokens: float = 0, requests: float = 0) -> None:
        self.pools = {"bulk": [tokens, requests], "interactive": [0.0, 0.0]}
        self.given_back: list[tuple[str, float, float]] = []
        self.pauses: list[float] = []
        self.takes = 0

    def add(self, priority: str, tokens: float, requests: float) -> None:
        self.pools[priority][0] += tokens
        self.pools[priority][1] += requests

    async def configure(self, provider: str, model: str, limits: BucketLimits) -> None:
        return None

    async def take(self, provider: str, model: str, priority: str, *, need_tokens: float,
                   want_tokens: float, want_requests: float) -> Grant:
        self.takes += 1
        sources = ["interactive", "bulk"] if priority == "interactive" else ["bulk"]
        tokens = sum(self.pools[p][0] for p in sources)
        requests = sum(self.pools[p][1] for p in sources)
        if tokens < need_tokens or requests < 1:
            return Grant(0, 0, 0.01)
        grant_t, grant_r = min(want_tokens, tokens), min(want_requests, requests)
        left_t, left_r = grant_t, grant_r
        for p in sources:
            t, r = min(self.pools[p][0], left_t), min(self.pools[p][1], left_r)
            self.pools[p][0] -= t
            self.pools[p][1] -= r
            left_t -= t
            left_r -= r
        return Grant(grant_t, grant_r)

    async def give_back(self, provider: str, model: str, priority: str, tokens: float,
                        requests: float) -> None:
        self.given_back.append((priority, tokens, requests))
        self.add(priority, tokens, requests)

    async def pause(self, provider: str, model: str, seconds: float) -> None:
        self.pauses.append(seconds)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


LIMITS = BucketLimits(tokens_per_minute=60_000, requests_per_minute=600, lease_seconds=0.5)


async def _budget(ledger: MemoryLedger, clock: Clock | None = None) -> TokenBudget:
    budget = TokenBudget(ledger, "fake", "m", LIMITS, slice_seconds=0.25,
                         **({"clock": clock} if clock else {}))
    await budget.start()
    return budget


async def _until(check: Any, within: float = 2.0) -> None:
    """Wait for a condition with a deadline (the async twin of tests.support.waiting.wait_for)."""
    async with asyncio.timeout(within):
        while not check():  # noqa: ASYNC110 - polling a condition under a deadline
            await asyncio.sleep(0.005)


def test_limits_keep_a_sliding_minute_under_the_provider_limit() -> None:
    """A full bucket plus a minute and a lease of refill never exceeds the provider's limit."""
    for tpm, rpm, share in [(2_000_000, 0, 0.2), (60_000, 600, 0.1), (0, 120, 0.2)]:
        limits = BucketLimits(tpm, rpm, interactive_share=share, burst_seconds=1.0,
                              lease_seconds=0.5)
        assert limits.token_cap + limits.token_rate * 60.5 <= tpm + 1e-6
        assert limits.request_cap + limits.request_rate * 60.5 <= rpm + 1e-6
        if rpm:
            assert limits.request_cap * share >= 1 - 1e-9  # interactive can hold one call
        if tpm:
            assert limits.token_rate * 60 >= 0.95 * tpm  # and the quota is still used


def test_estimate_counts_about_four_characters_a_token() -> None:
    """The prompt estimate is the characters of every message over four, rounded up."""
    assert estimate_prompt_tokens([{"role": "user", "content": "x" * 400},
                                   {"role": "system", "content": "y" * 2}]) == 101


def test_cost_uses_provider_specific_price_first() -> None:
    """A provider:model price wins over the bare model's; an unknown model costs 0."""
    prices = {"m": ModelPrice(input=1, output=2), "openai:m": ModelPrice(input=10, output=20)}
    assert cost_usd(prices, "anthropic", "m", 1_000_000, 500_000) == pytest.approx(2.0)
    assert cost_usd(prices, "openai", "m", 1_000_000, 0) == pytest.approx(10.0)
    assert cost_usd(prices, "openai", "other", 1_000, 1_000) == 0.0


async def test_call_waits_until_the_ledger_has_budget() -> None:
    """A call is held while the fleet ledger has nothing and proceeds once budget appears."""
    ledger = MemoryLedger()
    budget = await _budget(ledger)
    try:
        call = asyncio.create_task(budget.acquire(100, "bulk"))
        await _until(lambda: ledger.takes >= 2)
        assert not call.done()
        ledger.add("bulk", 1000, 10)
        reservation = await asyncio.wait_for(call, 2)
        assert reservation.tokens == 100
    finally:
        await budget.close()


async def test_interactive_is_served_before_bulk_queued_earlier() -> None:
    """With bulk and interactive calls waiting, new budget goes to interactive first."""
    ledger = MemoryLedger()
    budget = await _budget(ledger)
    order: list[str] = []

    async def call(priority: str) -> None:
        await budget.acquire(100, priority)
        order.append(priority)

    try:
        bulk = [asyncio.create_task(call("bulk")) for _ in range(3)]
        await _until(lambda: budget.waiting == 3)
        interactive = asyncio.create_task(call("interactive"))
        await _until(lambda: budget.waiting == 4)
        ledger.add("bulk", 100, 1)  # room for exactly one call
        await _until(lambda: len(order) == 1)
        assert order == ["interactive"]
        ledger.add("bulk", 300, 3)
        await asyncio.wait_for(asyncio.gather(*bulk, interactive), 2)
    finally:
        await budget.close()


class SlowBulkLedger(MemoryLedger):
    """Its bulk leases wait for ``gate`` (a ledger round trip under load), then come back
    empty with the longest pause the dispatcher takes (0.25 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.bulk_asked = asyncio.Event()

    async def take(self, provider: str, model: str, priority: str, *, need_tokens: float,
                   want_tokens: float, want_requests: float) -> Grant:
        if priority == "bulk":
            self.bulk_asked.set()
            await self.gate.wait()
            return Grant(0, 0, 0.25)
        return await super().take(provider, model, priority, need_tokens=need_tokens,
                                  want_tokens=want_tokens, want_requests=want_requests)


async def test_an_interactive_call_is_not_kept_behind_a_bulk_lease_in_flight() -> None:
    """An interactive call that arrives while the dispatcher asks the ledger for bulk budget
    asks the ledger itself at once: it is served while that round trip is still out (it
    used to wait for it, and under a bulk flood for the bulk's pause after it)."""
    ledger = SlowBulkLedger()
    ledger.add("interactive", 1000, 10)
    budget = await _budget(ledger)
    try:
        bulk = asyncio.create_task(budget.acquire(100, "bulk"))
        await asyncio.wait_for(ledger.bulk_asked.wait(), 2)
        reservation = await asyncio.wait_for(budget.acquire(100, "interactive"), 2)
        assert reservation.source == "interactive"
        assert not ledger.gate.is_set()  # the bulk lease is still out
        assert not bulk.done()
        bulk.cancel()
    finally:
        ledger.gate.set()
        await budget.close()


async def test_interactive_asks_ahead_so_the_next_calls_need_no_round_trip() -> None:
    """One interactive call takes its share of a slice from the ledger: the next calls of
    the trickle are paid from it, with no ledger round trip each."""
    ledger = MemoryLedger()
    ledger.add("interactive", 100_000, 1_000)
    # 200 calls a second: a 0.25 s slice holds 50, and interactive's fifth of it 10
    budget = TokenBudget(ledger, "fake", "m", BucketLimits(600_000, 12_000, lease_seconds=0.5))
    await budget.start()
    try:
        await asyncio.wait_for(budget.acquire(100, "interactive"), 1)
        takes = ledger.takes
        for _ in range(3):
            await asyncio.wait_for(budget.acquire(100, "interactive"), 1)
        assert ledger.takes == takes
    finally:
        await budget.close()


async def test_a_bulk_queue_at_the_quota_asks_the_ledger_once_a_pause() -> None:
    """Bulk calls held at the quota: the dispatcher asks the fleet's ledger once per pause
    (_BULK_PAUSE), not once per arriving call and every few milliseconds (a round trip to
    the bucket row each, 9 % of a worker's CPU under a bulk flood)."""
    ledger = MemoryLedger()  # nothing for bulk: every take comes back empty (wait 10 ms)
    budget = await _budget(ledger)
    calls = []
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        for _ in range(30):  # one arrival every 10 ms for 0.3 s
            calls.append(asyncio.create_task(budget.acquire(100, "bulk")))
            await asyncio.sleep(0.01)
        elapsed = loop.time() - started  # longer on a loaded host: more pauses fit in it
        assert budget.waiting == 30
        # One ask per 50 ms pause and the first arrival's own (the old dispatcher asked at
        # every arrival and every 10 ms: over 30)
        assert ledger.takes <= elapsed / 0.05 + 2
        assert ledger.takes < 30
    finally:
        for call in calls:
            call.cancel()
        await budget.close()


async def test_bulk_cannot_take_the_interactive_share() -> None:
    """Budget held for interactive stays unused by bulk calls."""
    ledger = MemoryLedger()
    ledger.add("interactive", 1000, 10)
    budget = await _budget(ledger)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(budget.acquire(100, "bulk"), 0.2)
        assert (await asyncio.wait_for(budget.acquire(100, "interactive"), 1)).source == \
            "interactive"
    finally:
        await budget.close()


async def test_one_lease_serves_several_calls_and_settlements_go_back() -> None:
    """Calls waiting together share one slice; what they did not use goes back after a lease."""
    ledger = MemoryLedger()
    clock = Clock()
    budget = await _budget(ledger, clock)
    try:
        calls = [asyncio.create_task(budget.acquire(100, "bulk")) for _ in range(2)]
        await _until(lambda: budget.waiting == 2)
        takes = ledger.takes
        ledger.add("bulk", 1000, 10)
        reservations = await asyncio.wait_for(asyncio.gather(*calls), 1)
        assert ledger.takes == takes + 1  # one slice for both calls
        assert ledger.pools["bulk"] == [800, 8]
        for reservation in reservations:
            reservation.settle(60)  # the provider counted 40 fewer than reserved
        clock.now += 1.0  # past the lease
        budget._wake_all()
        await _until(lambda: bool(ledger.given_back))
        [(priority, tokens, requests)] = ledger.given_back
        assert (priority, requests) == ("bulk", 0.0)
        assert tokens == pytest.approx(80)
    finally:
        await budget.close()


async def test_pause_holds_every_call_and_tells_the_fleet_once() -> None:
    """After a 429 pause nothing is handed out until it ends; the ledger hears of it once."""
    ledger = MemoryLedger(tokens=10_000, requests=100)
    clock = Clock()
    budget = await _budget(ledger, clock)
    try:
        await budget.pause_fleet(5.0)
        await budget.pause_fleet(2.0)  # inside the first pause: nothing new to tell
        assert ledger.pauses == [5.0]
        call = asyncio.create_task(budget.acquire(100, "interactive"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(call), 0.1)
        clock.now += 5.1
        budget._wake_all()
        await asyncio.wait_for(call, 2)
    finally:
        await budget.close()


async def test_cancelled_call_does_not_consume_budget() -> None:
    """A call that gives up waiting (step timeout) leaves the budget to the next one."""
    ledger = MemoryLedger()
    budget = await _budget(ledger)
    try:
        first = asyncio.create_task(budget.acquire(100, "bulk"))
        await _until(lambda: budget.waiting == 1)
        first.cancel()
        ledger.add("bulk", 100, 1)
        second = await asyncio.wait_for(budget.acquire(100, "bulk"), 1)
        assert second.tokens == 100
    finally:
        await budget.close()


async def test_rate_limit_answer_pauses_the_fleet_for_retry_after() -> None:
    """A 429 with Retry-After pauses the budget that long and still fails the attempt."""
    ledger = MemoryLedger(tokens=10_000, requests=100)
    budget = await _budget(ledger)
    inner = ScriptedProvider(StepFailure("429", code="rate_limited",
                                         failure_class=FailureClass.TRANSIENT, retry_after=7))
    provider = BudgetedProvider(inner, provider="openai", model="m", budget=budget)
    try:
        with pytest.raises(StepFailure) as caught:
            await provider.complete(messages=[{"role": "user", "content": "hi"}], job_id="j",
                                    max_tokens=10)
        assert caught.value.code == "rate_limited"
        assert ledger.pauses == [7]
    finally:
        await provider.close()


async def test_settles_with_what_the_provider_counted() -> None:
    """Counting max_tokens, a reply settles at real prompt tokens plus max_tokens."""
    ledger = MemoryLedger(tokens=10_000, requests=100)
    budget = await _budget(ledger)
    inner = ScriptedProvider(ModelReply("{}", None, input_tokens=50, output_tokens=5))
    provider = BudgetedProvider(inner, provider="openai", model="m", budget=budget)
    enter_scope(CallScope(priority="interactive"))
    try:
        # 400 characters: estimated 100 prompt tokens; the provider counted 50.
        await provider.complete(messages=[{"role": "user", "content": "x" * 400}], job_id="j",
                                max_tokens=20)
        assert budget._owed["interactive"] + budget._owed["bulk"] == pytest.approx(50)
    finally:
        await provider.close()


async def test_in_flight_limit_follows_the_budget_rate() -> None:
    """A worker held back by the budget holds what its share starts within the queue time;
    one that is not (or has no budget) is not limited below the fleet's rate."""
    ledger = MemoryLedger()
    clock = Clock()
    budget = await _budget(ledger, clock)
    provider = BudgetedProvider(ScriptedProvider(), provider="openai", model="m", budget=budget)
    fleet_limit = math.ceil(LIMITS.request_rate * 10) + 1  # 600 a minute: ~9.75 a second
    try:
        assert provider.in_flight_limit(10) == fleet_limit
        # Calls keep waiting for 10 s while the fleet hands this worker 2 calls a second.
        calls = [asyncio.create_task(budget.acquire(10, "bulk")) for _ in range(30)]
        await _until(lambda: budget.waiting == 30)
        for i in range(20):
            ledger.add("bulk", 10, 1)
            await _until(lambda: sum(c.done() for c in calls) == i + 1)  # noqa: B023
            clock.now += 0.5
        assert provider.in_flight_limit(10) == 21
        ledger.add("bulk", 100, 10)
        await asyncio.wait_for(asyncio.gather(*calls), 2)
        # Nothing waits any more: its own low demand does not shrink the worker.
        assert provider.in_flight_limit(10) == fleet_limit
    finally:
        await provider.close()
    assert BudgetedProvider(ScriptedProvider(), provider="openai", model="m").in_flight_limit(
        10) is None


class ObservingProvider(ScriptedProvider):
    """A scripted provider that tells its observer the limits each answer states (as the
    gateway does from the rate-limit headers)."""

    def __init__(self, limits: Any, *answers: ModelReply | StepFailure) -> None:
        super().__init__(*answers)
        self.limits = limits
        self.observer: Any = None

    async def complete(self, **kw: Any) -> ModelReply:
        if self.observer is not None:
            self.observer(200, self.limits)
        return await super().complete(**kw)


async def test_a_budget_above_the_stated_limit_is_brought_down_to_it() -> None:
    """Configured at twice what the provider's headers state: lowered to it (never raised),
    and both figures are shown as metrics."""
    from prometheus_client import REGISTRY

    from calmq.calls.wires import RateLimits

    ledger = MemoryLedger(tokens=10_000, requests=100)
    budget = TokenBudget(ledger, "openai:x", "m2", BucketLimits(120_000, 1200),
                         slice_seconds=0.25)
    await budget.start()
    stated = RateLimits(requests_per_minute=600, tokens_per_minute=60_000,
                        names=("x-ratelimit-limit-tokens",))
    inner = ObservingProvider(stated, ModelReply("{}", None, 5, 5), ModelReply("{}", None, 5, 5))
    provider = BudgetedProvider(inner, provider="openai", model="m2", budget=budget)
    try:
        await provider.complete(messages=[{"role": "user", "content": "hi"}], job_id="j",
                                max_tokens=10)
        await _until(lambda: budget.limits.tokens_per_minute == 60_000)
        assert (budget.limits.tokens_per_minute, budget.limits.requests_per_minute) == (
            60_000, 600)
        assert await budget.lower_to(90_000, 900) is False  # never raised
        observed = REGISTRY.get_sample_value("calmq_provider_limit_per_minute", {
            "provider": "openai", "model": "m2", "limit": "tokens_per_minute",
            "source": "observed"})
        configured = REGISTRY.get_sample_value("calmq_provider_limit_per_minute", {
            "provider": "openai", "model": "m2", "limit": "tokens_per_minute",
            "source": "configured"})
        assert (observed, configured) == (60_000, 60_000)
    finally:
        await provider.close()


async def test_with_no_budget_set_one_starts_from_the_stated_limits() -> None:
    """No budget configured: the first stated limits make one (learn_limits)."""
    from calmq.calls.wires import RateLimits

    ledger = MemoryLedger(tokens=10_000, requests=100)
    made: list[TokenBudget] = []

    async def learn(stated: RateLimits) -> TokenBudget | None:
        budget = TokenBudget(ledger, "openai:x", "m3",
                             BucketLimits(stated.tokens_per_minute or 0,
                                          stated.requests_per_minute or 0))
        await budget.start()
        made.append(budget)
        return budget

    stated = RateLimits(requests_per_minute=600, tokens_per_minute=60_000,
                        names=("x-ratelimit-limit-tokens",))
    inner = ObservingProvider(stated, ModelReply("{}", None, 5, 5), ModelReply("{}", None, 5, 5))
    provider = BudgetedProvider(inner, provider="openai", model="m3", learn_limits=learn)
    try:
        await provider.complete(messages=[{"role": "user", "content": "hi"}], job_id="j",
                                max_tokens=10)
        await _until(lambda: provider.budget is not None)
        assert provider.budget is made[0]
        assert provider.budget.limits.tokens_per_minute == 60_000
        await provider.complete(messages=[{"role": "user", "content": "hi"}], job_id="j",
                                max_tokens=10)
        assert ledger.takes >= 1  # the second call went through the learned budget
    finally:
        await provider.close()


async def test_a_bad_key_blocks_the_provider_and_later_calls_do_not_reach_it() -> None:
    """A 401 that the probe call confirms becomes ProviderBlocked (no retry, no dead
    letter), later calls are refused without a call, and a successful probe lifts the
    block."""
    from calmq.calls.gate import ProviderGate
    from calmq.failure_codes import ProviderBlocked, failure

    inner = ScriptedProvider(failure("provider_auth", "401 bad key"),
                             failure("provider_auth", "401 bad key (the confirming probe)"),
                             ModelReply("{}", None, 1, 1))
    lifted: list[bool] = []

    async def probe() -> object:
        return await inner.complete(messages=[], job_id="probe", max_tokens=1)

    async def released() -> None:
        lifted.append(True)

    gate = ProviderGate("openai:x", "m4", probe=probe, on_unblocked=released)
    provider = BudgetedProvider(inner, provider="openai", model="m4", gate=gate)
    messages = [{"role": "user", "content": "hi"}]
    try:
        with pytest.raises(ProviderBlocked) as first:
            await provider.complete(messages=messages, job_id="j", max_tokens=10)
        assert (first.value.code, first.value.met) == ("provider_auth", True)
        with pytest.raises(ProviderBlocked) as second:
            await provider.complete(messages=messages, job_id="j", max_tokens=10)
        assert second.value.met is False  # refused here, before it was sent
        assert inner.calls == 2  # the call and its probe; the second call never reached it
        assert await gate.probe_once() is True
        assert (gate.blocked, lifted) == (None, [True])
    finally:
        await provider.close()


async def test_a_rate_limit_pauses_calls_for_the_retry_after_without_a_budget() -> None:
    """No budget: a 429 with retry-after-ms pauses the gate exactly that long."""
    from calmq.calls.gate import ProviderGate
    from calmq.failure_codes import failure

    clock = Clock()
    gate = ProviderGate("openai:x", "m5", clock=clock)
    inner = ScriptedProvider(failure("rate_limited", "429", retry_after=1.2))
    provider = BudgetedProvider(inner, provider="openai", model="m5", gate=gate)
    with pytest.raises(StepFailure):
        await provider.complete(messages=[{"role": "user", "content": "x"}], job_id="j",
                                max_tokens=5)
    assert gate.paused_until == pytest.approx(clock.now + 1.2)
    await provider.close()
