"""The API's fairness primitives: a token bucket per key, per-tenant caps on what is held."""

from __future__ import annotations

import uuid

import pytest

from calmq.producers.throttle import RateLimiter, TenantGates, Throttled


def test_a_bucket_allows_its_burst_then_its_rate() -> None:
    """A key sends its burst at once, then one request per 1/rate seconds; keys are apart."""
    limiter = RateLimiter(rate=2.0, burst=3)
    assert [limiter.take("a", now=10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a", now=10.0) == pytest.approx(0.5)
    assert limiter.take("b", now=10.0) == 0.0
    assert limiter.take("a", now=10.5) == 0.0  # one token back after 1/rate


def test_a_zero_rate_limits_nothing() -> None:
    """api_rate_per_second 0 turns the limit off."""
    limiter = RateLimiter(rate=0.0, burst=1)
    assert [limiter.take("a", now=1.0) for _ in range(100)] == [0.0] * 100


def test_past_the_rate_check_raises_429_with_retry_after() -> None:
    """check() raises Throttled rate_limited with a Retry-After of whole seconds, at least 1."""
    limiter = RateLimiter(rate=0.1, burst=1)
    limiter.check("k")
    with pytest.raises(Throttled) as caught:
        limiter.check("k")
    assert caught.value.status == 429
    assert caught.value.code == "rate_limited"
    assert caught.value.retry_after_header == "10"


def test_a_tenant_holds_at_most_its_cap_and_gets_places_back() -> None:
    """Past its cap a tenant is refused at once; other tenants are not; a place is given
    back when its holder ends, even by an error."""
    gates = TenantGates(streams=2, reads=0)
    one, two = uuid.uuid4(), uuid.uuid4()
    with gates.hold("stream", one), gates.hold("stream", one):
        with pytest.raises(Throttled) as caught, gates.hold("stream", one):
            pass
        assert caught.value.code == "too_many_streams"
        with gates.hold("stream", two):
            assert gates.held("stream", two) == 1
    assert gates.held("stream", one) == 0
    with pytest.raises(RuntimeError), gates.hold("stream", one):
        raise RuntimeError("the client went away")
    assert gates.held("stream", one) == 0
    for _ in range(50):  # reads: no cap
        with gates.hold("read", one):
            pass


def test_wait_reads_a_bucket_without_spending_it() -> None:
    """wait() says how long until a token is back and takes none: the unauthenticated check
    before a key lookup must not spend the address's bucket by itself."""
    limiter = RateLimiter(rate=1.0, burst=2)
    assert [limiter.wait("a", now=5.0) for _ in range(5)] == [0.0] * 5
    limiter.take("a", now=5.0)
    limiter.take("a", now=5.0)
    assert limiter.wait("a", now=5.0) == pytest.approx(1.0)
    assert limiter.wait("a", now=5.5) == pytest.approx(0.5)
    assert limiter.wait("b", now=5.0) == 0.0
