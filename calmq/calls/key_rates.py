"""Rate limits per concurrency key: a workflow's ``key_rate_limit`` (requests and/or tokens
per window) holds each key's model calls under it, fleet-wide.

A job's ``concurrency_key`` (a customer inside the tenant, given at submit) names its
bucket, one per tenant, key and workflow, in PostgreSQL (calmq.data.rate_keys): a token
bucket that starts full and refills evenly over the window. Each model call of the job's
steps reserves one request and its token estimate (prompt estimate plus ``max_tokens``)
before it is sent, in one statement that takes turns with every other worker's on the
bucket's row, and settles the tokens with what the provider counted afterwards: the same
reserve/settle discipline as the fleet's token budget (calmq.calls.budget), whose estimate it
shares (calmq.calls.meter). A call the provider refused or never got gives its tokens back;
one it may have counted (a timeout, a cut-off answer) keeps them, as the budget's do.

A call that does not fit is not made: ``KeyRateLimited`` hands the job back to wait in
``queued`` (``waiting_reason`` ``rate_limit_key``) with no attempt counted, for as long as
the bucket needs to refill for it behind the key's jobs already waiting, so that a backlog
comes back a refill at a time, not all at once. The release pass re-publishes it then.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from calmq.calls.meter import charged_on_failure, estimate_prompt_tokens
from calmq.calls.wires import ModelReply, ModelStream, Provider, Streamer
from calmq.data.rate_keys import Reservation
from calmq.failure_codes import KeyRateLimited, failure
from calmq.workflows import KeyRateLimit

__all__ = ["Buckets", "KeyRateLimiter"]

# The least a refused call waits: the bucket refills continuously, and a wait of nothing
# would hand the job straight back again.
MIN_WAIT_SECONDS = 0.05


class Buckets(Protocol):
    """What the limiter needs of the buckets (calmq.data.rate_keys.RateKeys)."""

    async def reserve(self, tenant_id: uuid.UUID | str, key: str, scope: str, *,
                      requests: int, tokens: int, requests_cap: int, tokens_cap: int,
                      per_seconds: float) -> Reservation: ...

    async def settle(self, tenant_id: uuid.UUID | str, key: str, scope: str, *,
                     refund: float, tokens_cap: int) -> None: ...

    async def waiting(self, tenant_id: uuid.UUID | str, key: str) -> int: ...


class KeyRateLimiter:
    """The provider a step sees for a job whose workflow limits its key's rate."""

    def __init__(self, inner: Provider, buckets: Buckets, *, tenant_id: uuid.UUID | str,
                 key: str, scope: str, limit: KeyRateLimit) -> None:
        self.inner = inner
        self.buckets = buckets
        self.tenant_id = tenant_id
        self.key = key
        self.scope = scope
        self.limit = limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # embed, model, ...: the inner provider's

    def _estimate(self, messages: list[dict[str, str]], max_tokens: int) -> int:
        if self.limit.tokens is None:
            return 0
        estimate = estimate_prompt_tokens(messages) + max_tokens
        if estimate > self.limit.tokens:
            raise failure("request_too_large",
                          f"the call's estimate of {estimate} tokens is more than the key "
                          f"rate limit's {self.limit.tokens} tokens per "
                          f"{self.limit.per_seconds:g} s: it could never run")
        return estimate

    async def _reserve(self, estimate: int) -> None:
        limit = self.limit
        wanted = 1 if limit.requests else 0
        got = await self.buckets.reserve(
            self.tenant_id, self.key, self.scope, requests=wanted, tokens=estimate,
            requests_cap=limit.requests or 0, tokens_cap=limit.tokens or 0,
            per_seconds=limit.per_seconds)
        if got.taken:
            return
        # Behind the key's jobs that wait already: each of them takes its share first.
        ahead = await self.buckets.waiting(self.tenant_id, self.key)
        seconds = MIN_WAIT_SECONDS
        if limit.requests:
            short = wanted * (ahead + 1) - got.requests_left
            seconds = max(seconds, short * limit.per_seconds / limit.requests)
        if limit.tokens:
            short = estimate * (ahead + 1) - got.tokens_left
            seconds = max(seconds, short * limit.per_seconds / limit.tokens)
        raise KeyRateLimited(seconds, self.key, limit.as_detail())

    async def _settle(self, estimate: int, used: float) -> None:
        """Tokens back: what the call reserved and did not use (negative: it used more)."""
        if not estimate:
            return
        refund = estimate - used
        # Shielded: a call cancelled at its timeout still settles its reservation.
        await asyncio.shield(self.buckets.settle(
            self.tenant_id, self.key, self.scope, refund=refund,
            tokens_cap=self.limit.tokens or 0))

    async def complete(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                       response_schema: dict[str, Any] | None = None) -> ModelReply:
        estimate = self._estimate(messages, max_tokens)
        await self._reserve(estimate)
        try:
            reply = await self.inner.complete(messages=messages, job_id=job_id,
                                              max_tokens=max_tokens,
                                              response_schema=response_schema)
        except BaseException as exc:
            # What the failure cost, as the budget counts it (calmq.calls.meter).
            await self._settle(estimate, charged_on_failure(exc, estimate))
            raise
        await self._settle(estimate, reply.input_tokens + reply.output_tokens)
        return reply

    def stream(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
               response_schema: dict[str, Any] | None = None) -> ModelStream:
        """A streamed call under the key's limit: reserved before it is sent, settled when
        it ended, or as the budget settles a failed call: a stream refused before it began
        gives its tokens back, one that broke off or was stopped keeps its estimate."""
        inner = self.inner
        if not isinstance(inner, Streamer):
            raise failure("not_supported", "the provider cannot stream")

        async def source(out: ModelStream) -> AsyncIterator[str]:
            estimate = self._estimate(messages, max_tokens)
            await self._reserve(estimate)
            streamed = inner.stream(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                    response_schema=response_schema)
            try:
                async for text in streamed:
                    yield text
                reply = await streamed.final()
            except BaseException as exc:  # refused, broken off, cancelled or stopped early
                await streamed.aclose()
                await self._settle(estimate, charged_on_failure(exc, estimate))
                raise
            await self._settle(estimate, reply.input_tokens + reply.output_tokens)
            out.reply = reply

        return ModelStream(source)

    async def close(self) -> None:
        return None  # the worker's provider is the worker's to close
