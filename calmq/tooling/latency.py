"""Latency distributions for the fake provider: how long a model call takes.

Real model calls do not take a fixed time: they take 5-60 s with a long tail, so calls
that start together end spread out. A fixed latency makes a worker's calls start and end
in waves, which hides what a spread of latencies costs (many small wake-ups instead of a
few large ones). A distribution is written as a short spec, the same on the command line
and in settings:

- ``fixed:value=2s`` — every call takes 2 s (``fixed:2000`` is the same).
- ``lognormal:median=8s,p99=40s`` — log-normal with that median and 99th percentile
  (``seed=N`` makes the draws repeatable; the default seed is fixed, so runs are too).

Durations take ``ms`` or ``s``; a bare number is milliseconds, like ``--latency-ms``.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from statistics import NormalDist
from typing import Final

__all__ = ["LatencyDistribution", "parse_latency"]

# The standard normal's 99th percentile: p99 = median * exp(Z99 * sigma).
_Z99: Final = NormalDist().inv_cdf(0.99)
_DURATION: Final = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>ms|s)?$")
_DEFAULT_SEED: Final = 21


def _seconds(text: str, what: str) -> float:
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"{what} must be a duration such as 800ms, 8s or 8000, not {text!r}")
    n = float(m.group("n"))
    return n if m.group("unit") == "s" else n / 1000


@dataclass(frozen=True)
class LatencyDistribution:
    """A latency distribution: ``kind`` fixed (``median`` is the value) or lognormal."""

    kind: str
    median: float  # seconds
    p99: float  # seconds; equal to median for fixed
    seed: int = _DEFAULT_SEED

    @property
    def sigma(self) -> float:
        return math.log(self.p99 / self.median) / _Z99 if self.kind == "lognormal" else 0.0

    @property
    def mean(self) -> float:
        """Mean latency in seconds: what Little's law divides the calls in flight by."""
        return self.median * math.exp(self.sigma ** 2 / 2)

    def sampler(self) -> random.Random:
        return random.Random(self.seed)

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed" or self.median == 0:
            return self.median
        return rng.lognormvariate(math.log(self.median), self.sigma)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.median * 1000:g} ms"
        return (f"log-normal, median {self.median * 1000:g} ms, p99 {self.p99 * 1000:g} ms, "
                f"mean {self.mean * 1000:.0f} ms")


def parse_latency(spec: str) -> LatencyDistribution:
    """``fixed:value=2s`` or ``lognormal:median=8s,p99=40s[,seed=N]``; ValueError says what
    is wrong and what is expected."""
    kind, _, rest = spec.strip().partition(":")
    params: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            if kind == "fixed" and not params:
                key, value = "value", key
            else:
                raise ValueError(f"latency parameter {part!r} must be name=value")
        params[key.strip()] = value.strip()
    seed = _DEFAULT_SEED
    if "seed" in params:
        if not params["seed"].isdigit():
            raise ValueError(f"seed must be a whole number, not {params['seed']!r}")
        seed = int(params.pop("seed"))
    if kind == "fixed":
        if set(params) != {"value"}:
            raise ValueError("fixed latency takes one duration: fixed:value=2s")
        fixed = _seconds(params["value"], "value")
        return LatencyDistribution("fixed", fixed, fixed, seed)
    if kind == "lognormal":
        if set(params) != {"median", "p99"}:
            raise ValueError("log-normal latency takes median and p99: "
                             "lognormal:median=8s,p99=40s")
        median, p99 = _seconds(params["median"], "median"), _seconds(params["p99"], "p99")
        if median <= 0 or p99 <= median:
            raise ValueError(f"log-normal latency needs 0 < median < p99 (got median "
                             f"{params['median']}, p99 {params['p99']})")
        return LatencyDistribution("lognormal", median, p99, seed)
    raise ValueError(f"unknown latency distribution {kind!r}; expected fixed:value=2s or "
                     "lognormal:median=8s,p99=40s")
