"""The failure policy: what happens after an attempt failed.

``transient`` with attempts left -> retry through the delay tier whose delay is at least the
backoff (exponential, jittered over the attempt's band) and never below the provider's
Retry-After; everything
else, and an exhausted budget -> dead letter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from calmq.errors import StepFailure

__all__ = ["Backoff", "RetryDecision", "decide"]


@dataclass(frozen=True)
class Backoff:
    initial: float = 1.0
    maximum: float = 3600.0
    multiplier: float = 2.0

    def ceiling(self, attempt: int) -> float:
        """The exponential cap of attempt ``attempt`` (0 for attempt 0)."""
        if attempt < 1:
            return 0.0
        return min(self.maximum, self.initial * self.multiplier ** (attempt - 1))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Full jitter over the attempt's own band: uniform in
        [ceiling(attempt - 1), ceiling(attempt)].

        Plain full jitter draws from [0, ceiling] and so may wait less before the third
        attempt than before the second; drawing each attempt from the band above the
        previous cap keeps the spread that breaks up a thundering herd (the whole band is
        used) while the delays between attempts always grow (until the maximum).
        """
        return (rng or random).uniform(self.ceiling(attempt - 1), self.ceiling(attempt))


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    delay: float = 0.0
    tier: str | None = None


def decide(
    failure: StepFailure,
    attempt: int,
    max_attempts: int,
    tiers: list[tuple[str, float]],
    backoff: Backoff,
    *,
    rng: random.Random | None = None,
) -> RetryDecision:
    if not failure.retryable or attempt >= max_attempts:
        return RetryDecision(retry=False)
    delay = max(backoff.delay(attempt, rng), failure.retry_after or 0.0)
    # The shortest tier that is long enough; past the longest tier, the longest one.
    for name, seconds in tiers:
        if seconds >= delay:
            return RetryDecision(retry=True, delay=delay, tier=name)
    name, _seconds = tiers[-1]
    return RetryDecision(retry=True, delay=delay, tier=name)
