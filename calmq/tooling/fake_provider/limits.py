"""The fake provider's rate limits: requests and tokens admitted over a sliding minute, and
the rate-limit headers each provider sends with its answers."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import Final, NamedTuple

__all__ = ["WINDOW_SECONDS", "SlidingWindow", "Verdict", "limit_headers"]

WINDOW_SECONDS: Final = 60.0
# Compacting the window lists only once the dead prefix is large keeps expiry O(1)
# amortised without a per-request list shift.
_COMPACT_AT: Final = 4096


class Verdict(NamedTuple):
    admitted: bool
    retry_after: float
    limited_by: str  # "requests" or "tokens": OpenAI's error type for a 429
    too_large: bool


class SlidingWindow:
    """Requests and tokens admitted over the last 60 s.

    Entries live in two parallel lists (time, cumulative tokens) read from ``_head``; a
    running cumulative sum turns "tokens in the window" into one subtraction and "when will
    enough tokens free up" into one bisect, so neither admission nor rejection walks the
    window.
    """

    __slots__ = ("_base", "_clock", "_cum", "_head", "_rpm", "_times", "_total", "_tpm")

    def __init__(self, rpm: int, tpm: int, clock: Callable[[], float]) -> None:
        self._rpm = rpm
        self._tpm = tpm
        self._clock = clock
        self._times: list[float] = []
        self._cum: list[int] = []
        self._head = 0
        self._base = 0  # cumulative tokens of everything already expired
        self._total = 0  # cumulative tokens of everything ever admitted

    def reset(self) -> None:
        self._times.clear()
        self._cum.clear()
        self._head = 0
        self._base = 0
        self._total = 0

    def _expire(self, now: float) -> None:
        cutoff = now - WINDOW_SECONDS
        times, head = self._times, self._head
        end = len(times)
        while head < end and times[head] <= cutoff:
            head += 1
        if head != self._head:
            self._base = self._cum[head - 1]
            if head >= _COMPACT_AT and head * 2 >= end:
                del times[:head]
                del self._cum[:head]
                head = 0
            self._head = head

    def remaining(self) -> tuple[int, int]:
        """Requests and tokens still available right now (after the last admission)."""
        self._expire(self._clock())
        used_requests = len(self._times) - self._head
        used_tokens = self._total - self._base
        return max(0, self._rpm - used_requests), max(0, self._tpm - used_tokens)

    def admit(self, cost: int) -> Verdict:
        now = self._clock()
        self._expire(now)
        head = self._head
        count = len(self._times) - head
        wait = 0.0
        limited_by = "requests"
        if self._rpm and count >= self._rpm:
            # The (count - rpm + 1)-th oldest entry must expire before one more fits.
            wait = self._times[head + count - self._rpm] + WINDOW_SECONDS - now
        if self._tpm:
            if cost > self._tpm:
                return Verdict(False, WINDOW_SECONDS, "tokens", True)
            excess = self._total - self._base + cost - self._tpm
            if excess > 0:
                # First entry whose expiry frees at least `excess` tokens.
                index = bisect.bisect_left(self._cum, self._base + excess, lo=head)
                token_wait = self._times[index] + WINDOW_SECONDS - now
                if token_wait > wait:
                    wait, limited_by = token_wait, "tokens"
        if wait > 0:
            return Verdict(False, wait, limited_by, False)
        self._total += cost
        self._times.append(now)
        self._cum.append(self._total)
        return Verdict(True, 0.0, "", False)



def _reset(seconds: float) -> str:
    """OpenAI's reset duration format: ``1s``, ``6m0s``, ``0.5s``."""
    if seconds < 60:
        return f"{max(0.0, seconds):.3g}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest}s"


def limit_headers(*, anthropic: bool, rpm: int, tpm: int, requests_left: int,
                  tokens_left: int) -> dict[str, str]:
    """The rate-limit headers of an answer, in the provider's own names: OpenAI's
    ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, Anthropic's
    ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}``.
    A limit of 0 (none) sends no header for it."""
    headers: dict[str, str] = {}
    if anthropic:
        reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + WINDOW_SECONDS))
        if rpm:
            headers["anthropic-ratelimit-requests-limit"] = str(rpm)
            headers["anthropic-ratelimit-requests-remaining"] = str(requests_left)
            headers["anthropic-ratelimit-requests-reset"] = reset
        if tpm:
            for kind in ("tokens", "input-tokens"):
                headers[f"anthropic-ratelimit-{kind}-limit"] = str(tpm)
                headers[f"anthropic-ratelimit-{kind}-remaining"] = str(tokens_left)
                headers[f"anthropic-ratelimit-{kind}-reset"] = reset
        return headers
    if rpm:
        headers["x-ratelimit-limit-requests"] = str(rpm)
        headers["x-ratelimit-remaining-requests"] = str(requests_left)
        headers["x-ratelimit-reset-requests"] = _reset(
            WINDOW_SECONDS * (rpm - requests_left) / rpm)
    if tpm:
        headers["x-ratelimit-limit-tokens"] = str(tpm)
        headers["x-ratelimit-remaining-tokens"] = str(tokens_left)
        headers["x-ratelimit-reset-tokens"] = _reset(WINDOW_SECONDS * (tpm - tokens_left) / tpm)
    return headers
