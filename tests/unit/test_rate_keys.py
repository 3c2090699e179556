"""Rate limits per concurrency key (calmq.calls.key_rates): the limiter over an in-memory bucket
that keeps the SQL's rules (a token bucket refilled evenly over the window), with a
hand-set clock; the SQL itself runs in tests/integration/test_rate_limit_keys.py."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from calmq.calls.key_rates import KeyRateLimiter
from calmq.calls.meter import estimate_prompt_tokens
from calmq.calls.wires import ModelReply, ModelStream
from calmq.data.rate_keys import Reservation
from calmq.errors import FailureClass, StepFailure
from calmq.failure_codes import KeyRateLimited
from calmq.workflows import KeyRateLimit, Workflow
from calmq.workflows.summarize import SUMMARIZE

MESSAGES = [{"role": "user", "content": "x" * 400}]  # about 100 tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0


class MemoryBuckets:
    """calmq.data.rate_keys.RateKeys' interface over one dict, refilled like the SQL."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.rows: dict[tuple[str, str, str], list[float]] = {}  # requests, tokens, at
        self.waiters = 0

    async def reserve(self, tenant_id: uuid.UUID | str, key: str, scope: str, *,
                      requests: int, tokens: int, requests_cap: int, tokens_cap: int,
                      per_seconds: float) -> Reservation:
        row = self.rows.setdefault((str(tenant_id), key, scope),
                                   [requests_cap, tokens_cap, self.clock.now])
        elapsed = max(0.0, self.clock.now - row[2])
        have_r = min(requests_cap, row[0] + elapsed * requests_cap / per_seconds)
        have_t = min(tokens_cap, row[1] + elapsed * tokens_cap / per_seconds)
        fits = have_r >= requests and have_t >= tokens
        row[:] = [have_r - (requests if fits else 0), have_t - (tokens if fits else 0),
                  self.clock.now]
        return Reservation(fits, row[0], row[1])

    async def settle(self, tenant_id: uuid.UUID | str, key: str, scope: str, *,
                     refund: float, tokens_cap: int) -> None:
        row = self.rows[(str(tenant_id), key, scope)]
        row[1] = min(tokens_cap, row[1] + refund)

    async def waiting(self, tenant_id: uuid.UUID | str, key: str) -> int:
        return self.waiters


class Answers:
    def __init__(self, failure: StepFailure | None = None) -> None:
        self.calls = 0
        self.failure = failure

    async def complete(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                       response_schema: dict[str, Any] | None = None) -> ModelReply:
        self.calls += 1
        if self.failure is not None:
            raise self.failure
        return ModelReply(content="ok", refusal=None, input_tokens=100, output_tokens=20)

    async def close(self) -> None:
        return None


class Streams(Answers):
    """A streaming provider: two deltas then the reply, or ``code`` after ``failed_after``
    deltas (0: refused before it began)."""

    def __init__(self, failed_after: int | None, code: str | None) -> None:
        super().__init__()
        self.failed_after, self.code = failed_after, code

    def stream(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
               response_schema: dict[str, Any] | None = None) -> ModelStream:
        async def source(out: ModelStream) -> AsyncIterator[str]:
            for sent, text in enumerate(("o", "k")):
                if sent == self.failed_after:
                    assert self.code is not None
                    raise StepFailure(self.code, code=self.code,
                                      failure_class=FailureClass.TRANSIENT)
                yield text
            out.reply = ModelReply(content="ok", refusal=None, input_tokens=100,
                                   output_tokens=20)

        return ModelStream(source)


def _limiter(limit: KeyRateLimit, buckets: MemoryBuckets, inner: Answers,
             key: str = "customer-1") -> KeyRateLimiter:
    return KeyRateLimiter(inner, buckets, tenant_id="t1", key=key, scope="summarize_keyed",
                          limit=limit)


async def _call(limiter: KeyRateLimiter) -> ModelReply:
    return await limiter.complete(messages=MESSAGES, job_id="j", max_tokens=50)


async def test_requests_past_the_limit_wait_uncounted_for_the_refill() -> None:
    clock = Clock()
    buckets, inner = MemoryBuckets(clock), Answers()
    limiter = _limiter(KeyRateLimit(requests=3, per_seconds=60), buckets, inner)
    for _ in range(3):
        await _call(limiter)
    with pytest.raises(KeyRateLimited) as held:
        await _call(limiter)
    assert held.value.seconds == pytest.approx(20.0)  # one request refills in 60 / 3 s
    assert held.value.reason == "rate_limit_key"
    assert held.value.detail["limit"] == {"requests": 3, "per_seconds": 60}
    assert inner.calls == 3  # the refused call was not made
    clock.now += 20
    await _call(limiter)
    assert inner.calls == 4


async def test_a_waiting_backlog_puts_a_new_call_behind_it() -> None:
    clock = Clock()
    buckets, inner = MemoryBuckets(clock), Answers()
    limiter = _limiter(KeyRateLimit(requests=1, per_seconds=10), buckets, inner)
    await _call(limiter)
    buckets.waiters = 4  # four jobs of the key wait already
    with pytest.raises(KeyRateLimited) as held:
        await _call(limiter)
    assert held.value.seconds == pytest.approx(50.0)  # its turn is the fifth refill


async def test_tokens_are_reserved_by_estimate_and_settled_by_what_was_used() -> None:
    clock = Clock()
    buckets, inner = MemoryBuckets(clock), Answers()
    limiter = _limiter(KeyRateLimit(tokens=400, per_seconds=60), buckets, inner)
    assert estimate_prompt_tokens(MESSAGES) + 50 == 150  # what each call reserves
    await _call(limiter)
    # reserved 150, used 120 (the reply's): the bucket holds 400 - 120
    assert buckets.rows[("t1", "customer-1", "summarize_keyed")][1] == pytest.approx(280)
    await _call(limiter)  # 160 left
    await _call(limiter)  # 150 fits in 160: 40 left
    with pytest.raises(KeyRateLimited) as held:
        await _call(limiter)
    assert inner.calls == 3
    assert held.value.seconds == pytest.approx((150 - 40) * 60 / 400)


@pytest.mark.parametrize(("code", "left"), [
    ("rate_limited", 400),  # refused: the provider counted nothing, the tokens come back
    ("timeout", 250),  # the provider may have counted it: the estimate stays spent
])
async def test_a_failed_call_settles_as_the_budget_does(code: str, left: float) -> None:
    clock = Clock()
    failed = StepFailure(code, code=code, failure_class=FailureClass.TRANSIENT)
    buckets, inner = MemoryBuckets(clock), Answers(failed)
    limiter = _limiter(KeyRateLimit(tokens=400, per_seconds=60), buckets, inner)
    with pytest.raises(StepFailure):
        await _call(limiter)
    assert buckets.rows[("t1", "customer-1", "summarize_keyed")][1] == pytest.approx(left)


@pytest.mark.parametrize(("failed_after", "code", "left"), [
    (0, "rate_limited", 400),  # refused before it began: the tokens come back
    (1, "stream_interrupted", 250),  # broke off after it began: the estimate stays spent
    (None, None, 280),  # answered: settled with what the provider counted (120 tokens)
])
async def test_a_stream_settles_as_the_budget_does(failed_after: int | None, code: str | None,
                                                   left: float) -> None:
    buckets = MemoryBuckets(Clock())
    limiter = _limiter(KeyRateLimit(tokens=400, per_seconds=60), buckets,
                       Streams(failed_after, code))
    stream = limiter.stream(messages=MESSAGES, job_id="j", max_tokens=50)
    if code is None:
        assert [t async for t in stream] == ["o", "k"]
    else:
        with pytest.raises(StepFailure) as failed:
            async for _text in stream:
                pass
        assert failed.value.code == code
    assert buckets.rows[("t1", "customer-1", "summarize_keyed")][1] == pytest.approx(left)


async def test_a_call_larger_than_the_limit_fails_instead_of_waiting_for_ever() -> None:
    buckets, inner = MemoryBuckets(Clock()), Answers()
    limiter = _limiter(KeyRateLimit(tokens=100, per_seconds=60), buckets, inner)
    with pytest.raises(StepFailure) as raised:
        await _call(limiter)
    assert raised.value.code == "request_too_large"
    assert not raised.value.retryable
    assert inner.calls == 0


async def test_keys_do_not_share_a_bucket() -> None:
    clock = Clock()
    buckets, inner = MemoryBuckets(clock), Answers()
    limit = KeyRateLimit(requests=1, per_seconds=60)
    await _call(_limiter(limit, buckets, inner, "customer-1"))
    await _call(_limiter(limit, buckets, inner, "customer-2"))
    with pytest.raises(KeyRateLimited):
        await _call(_limiter(limit, buckets, inner, "customer-1"))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({}, "requests, tokens or both"), ({"requests": 0}, "requests is at least 1"),
    ({"tokens": 10, "per_seconds": 0}, "above 0"),
    ({"requests": 1, "per_seconds": 86_401}, "at most a day")])
def test_a_key_rate_limit_it_cannot_use_is_refused(kwargs: dict[str, Any], match: str
                                                   ) -> None:
    with pytest.raises(ValueError, match=match):
        KeyRateLimit(**kwargs)


def test_a_workflow_takes_a_key_rate_limit() -> None:
    limited = Workflow(SUMMARIZE.name, 1, SUMMARIZE.input_model, SUMMARIZE.steps,
                       key_rate_limit=KeyRateLimit(requests=5))
    assert limited.key_rate_limit is not None
    assert limited.key_rate_limit.as_detail() == {"requests": 5, "per_seconds": 60.0}
