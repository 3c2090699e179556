"""The budgeted provider: any ``Provider`` wrapped with the fleet's token budget
(calmq.calls.budget), its tenant's quota (calmq.calls.quota) and the meter
(calmq.calls.meter), so a worker wires it in one line (calmq.calls.stack's
``open_metered_provider``) and steps keep calling ``provider.complete``.

A 429 pauses the provider for the whole fleet until its Retry-After
(docs/explanation/token-budget.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from calmq.calls.budget import Reservation, TokenBudget, _metrics
from calmq.calls.caching import cache_use, meter_cache
from calmq.calls.gate import ProviderGate, provider_label
from calmq.calls.meter import UsageRecorder, charged_on_failure, estimate_prompt_tokens
from calmq.calls.pricing import ModelPrice, cost_usd
from calmq.calls.quota import TenantHold, TenantQuota
from calmq.calls.wires import (
    ModelReply,
    ModelStream,
    Provider,
    RateLimits,
    Streamer,
    current_clock,
    current_scope,
)
from calmq.errors import StepFailure
from calmq.failure_codes import failure

if TYPE_CHECKING:
    from calmq.calls.tiers import TierChooser

__all__ = ["BudgetedProvider"]

log = logging.getLogger(__name__)


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
