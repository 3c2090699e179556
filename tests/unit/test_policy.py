"""The failure policy: only transient failures retry; delays honour tiers and Retry-After."""

from __future__ import annotations

import random

from calmq.errors import FailureClass, StepFailure
from calmq.processors.policy import Backoff, decide

TIERS = [("5s", 5.0), ("30s", 30.0), ("2m", 120.0)]


def _failure(cls: FailureClass, retry_after: float | None = None) -> StepFailure:
    return StepFailure("x", code="c", failure_class=cls, retry_after=retry_after)


def test_non_transient_never_retries() -> None:
    """verifier, input, policy, permission, deadline and bug go straight to dead letter."""
    for cls in FailureClass:
        if cls is FailureClass.TRANSIENT:
            continue
        assert not decide(_failure(cls), 1, 5, TIERS, Backoff()).retry


def test_transient_retries_until_budget_spent() -> None:
    """A transient failure retries while attempts remain, then dead-letters."""
    assert decide(_failure(FailureClass.TRANSIENT), 1, 3, TIERS, Backoff()).retry
    assert decide(_failure(FailureClass.TRANSIENT), 2, 3, TIERS, Backoff()).retry
    assert not decide(_failure(FailureClass.TRANSIENT), 3, 3, TIERS, Backoff()).retry


def test_delay_never_below_retry_after() -> None:
    """Retry-After is a floor: the delay and the chosen tier are at least that long."""
    d = decide(_failure(FailureClass.TRANSIENT, retry_after=40), 1, 3, TIERS, Backoff(initial=0.1))
    assert d.delay >= 40
    assert d.tier == "2m"


def test_jitter_stays_within_the_attempts_band() -> None:
    """Delays are uniform in [cap(n-1), cap(n)] with cap(n) = initial * multiplier^(n-1)."""
    rng = random.Random(7)
    b = Backoff(initial=1, maximum=10, multiplier=2)
    for attempt in range(1, 8):
        low = 0 if attempt == 1 else min(10, 2 ** (attempt - 2))
        ceiling = min(10, 2 ** (attempt - 1))
        delays = [b.delay(attempt, rng) for _ in range(200)]
        assert all(low <= d <= ceiling for d in delays)
        if ceiling > low:
            assert max(delays) - min(delays) > (ceiling - low) * 0.8  # spread over the band


def test_delays_grow_from_attempt_to_attempt() -> None:
    """Whatever the draw, the delay before attempt n+1 is at least the one before attempt n."""
    b = Backoff(initial=0.5, maximum=100, multiplier=3)
    for seed in range(50):
        rng = random.Random(seed)
        delays = [b.delay(n, rng) for n in range(1, 6)]
        assert delays == sorted(delays)


def test_tier_is_shortest_long_enough() -> None:
    """The tier chosen is the shortest whose delay covers the computed backoff."""
    d = decide(_failure(FailureClass.TRANSIENT, retry_after=6), 1, 3, TIERS, Backoff(initial=0.01))
    assert d.tier == "30s"
