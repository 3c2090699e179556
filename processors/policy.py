"""The failure policy: what happens after an attempt failed.

``transient`` with attempts left -> retry through the delay tier whose delay is at least the
backoff (exponential, jittered over the attempt's band) and never below the provider's
Retry-After, which is bounded by the longest tier: one far-future (or ``inf``) Retry-After
must not hold a delay topic's partition head for every other tenant, nor overflow the due
time. Everything else, and an exhausted budget -> dead letter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from calmq.errors import StepFailure
from calmq.failure_codes import spec
from calmq.retrying import Backoff  # the kernel's one backoff; re-exported for the policy's users

__all__ = ["Backoff", "RetryDecision", "decide"]


@dataclass(frozen=True, slots=True)
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
    # Retried or not as the failure-code registry declares it (calmq.failure_codes).
    if not spec(failure.code, failure.failure_class).retried or attempt >= max_attempts:
        return RetryDecision(retry=False)
    longest = tiers[-1][1]
    # ``not >= 0`` also catches NaN; ``min`` bounds inf and huge values alike.
    asked = failure.retry_after if failure.retry_after is not None else 0.0
    floor = min(asked, longest) if asked >= 0 else 0.0
    delay = max(backoff.delay(attempt, rng), floor)
    # The shortest tier that is long enough; past the longest tier, the longest one.
    for name, seconds in tiers:
        if seconds >= delay:
            return RetryDecision(retry=True, delay=delay, tier=name)
    name, _seconds = tiers[-1]
    return RetryDecision(retry=True, delay=delay, tier=name)
