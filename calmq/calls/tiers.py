"""Service tiers: which tier a model call asks for, from the time its job has left.

OpenAI sells one model at several tiers (its SDK's ``service_tier``): the standard one,
``flex`` at about half the price with minutes of latency and occasional refusals for
capacity (a 429 ``resource_unavailable``), and ``priority`` at a premium. calmq knows what a
job may wait, so it asks per call for the cheapest tier that still meets it:

- an interactive job: the standard tier; ``priority`` only where the settings allow it
  (``service_tier_priority_tenants``), the standard tier's measured latency (without the
  margin, and only once it has answered) would miss the time left and priority's, with the
  margin, would not (unmeasured, priority is tried);
- a bulk job whose time left holds a flex call and, after it, a standard one: ``flex``;
  otherwise the standard tier (or ``priority``, as above);
- a day or more: the batch lane, chosen at submit (calmq.lanes), untouched here.

The time left is the earlier of the job's deadline and the end of the step's timeout
(``CallScope.deadline``). Latency is measured per provider, model and tier over the last
calls (``Latencies``: a high quantile of a rolling window, kept in memory); before a tier
has answered, the settings' estimate stands for it.

A flex call the provider refuses for capacity, or one still unanswered when only the
standard tier's time is left (the cut-off), is sent again at once at the standard tier,
inside the same call of the same attempt: no attempt is counted and no retry topic is
involved. Each call's chosen and served tier, the time it had left and a move are appended
to the attempt's model clock (the job's history) and counted in
``calmq_model_tier_calls_total``.

Only the tiers the settings enable (``service_tiers``) are asked, and only for a model with
a price for the tier (calmq.calls.pricing.tier_price): the settings refuse a tier the
configured model has no price for; a step's other allowed model without one is sent at the
standard tier, and a warning names it at startup.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import Counter

from calmq.calls.pricing import ModelPrice, tier_price
from calmq.calls.wires import SERVICE_TIER, CallScope, ModelReply, current_clock
from calmq.errors import ConfigError, StepFailure
from calmq.jobs import Priority

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = ["CHOOSABLE_TIERS", "Choice", "Latencies", "TierChooser", "TierPolicy",
           "chooser_for"]

log = logging.getLogger(__name__)

# The tiers calmq may choose (OpenAI's names); ``fast`` is answered as ``priority``.
CHOOSABLE_TIERS: Final = ("flex", "priority")
STANDARD: Final = "standard"
# The failure code of OpenAI's flex refusal for capacity (calmq.calls.wires.classify_status).
FLEX_REFUSED: Final = "flex_unavailable"
_WINDOW: Final = 64
_QUANTILE: Final = 0.9


@cache
def _calls() -> Counter:
    return Counter("calmq_model_tier_calls_total",
                   "Model calls by the tier calmq chose, the tier that served them, and why "
                   "a flex call moved to the standard tier (none, flex_refused, flex_late)",
                   ["provider", "model", "chosen", "served", "moved"])


@dataclass(frozen=True)
class TierPolicy:
    """The tier settings: which tiers may be asked, who may pay for ``priority``, the latency
    assumed of a tier before it has answered, and the safety factor on measured latency."""

    tiers: frozenset[str]
    priority_tenants: frozenset[str] = frozenset()  # empty: every tenant
    flex_seconds: float = 900.0
    standard_seconds: float = 60.0
    margin: float = 1.5

    @classmethod
    def from_settings(cls, settings: Settings) -> TierPolicy:
        return cls(tiers=frozenset(settings.service_tier_list),
                   priority_tenants=frozenset(settings.service_tier_priority_tenant_list),
                   flex_seconds=settings.service_tier_flex_seconds,
                   standard_seconds=settings.service_tier_standard_seconds,
                   margin=settings.service_tier_margin)

    def allows_priority(self, tenant: str) -> bool:
        return "priority" in self.tiers and (not self.priority_tenants
                                             or tenant in self.priority_tenants)


class Latencies:
    """Seconds of the last ``window`` answered calls per (provider, model, tier); the
    estimate is their ``quantile`` (0.9: a slow tail counts, one outlier does not)."""

    def __init__(self, window: int = _WINDOW, quantile: float = _QUANTILE) -> None:
        self._window = window
        self._quantile = quantile
        self._seen: dict[tuple[str, str, str], deque[float]] = {}

    def observe(self, provider: str, model: str, tier: str, seconds: float) -> None:
        key = (provider, model, tier)
        kept = self._seen.get(key)
        if kept is None:
            kept = self._seen[key] = deque(maxlen=self._window)
        kept.append(seconds)

    def estimate(self, provider: str, model: str, tier: str, default: float) -> float:
        kept = self._seen.get((provider, model, tier))
        if not kept:
            return default
        ordered = sorted(kept)
        return ordered[min(len(ordered) - 1, math.ceil(self._quantile * len(ordered)) - 1)]


@dataclass(frozen=True)
class Choice:
    """The tier one call asks (None: none named, the standard tier), and for a flex call the
    wall time by which it must have answered, else it moves to the standard tier."""

    tier: str | None
    cutoff: float | None = None


class TierChooser:
    """The tier of each call to one provider and model, and the call at it."""

    def __init__(self, policy: TierPolicy, provider: str, model: str, *,
                 latencies: Latencies | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self.provider = provider
        self.model = model
        self.latencies = latencies or Latencies()
        self._clock = clock

    def _need(self, tier: str) -> float:
        # Priority before it has answered: assumed to meet any time (tried, then measured).
        default = {"flex": self.policy.flex_seconds, "priority": 0.0}.get(
            tier, self.policy.standard_seconds)
        return self.policy.margin * self.latencies.estimate(self.provider, self.model, tier,
                                                            default)

    def _standard_misses(self, left: float) -> bool:
        """Whether the standard tier, as measured, would miss ``left``: its measured latency
        (the quantile, without the margin) is longer. Never before it has answered: the
        settings' estimate is a bound for flex's cut-off, not evidence that it is slow."""
        measured = self.latencies.estimate(self.provider, self.model, STANDARD, math.nan)
        return not math.isnan(measured) and left < measured

    def choose(self, scope: CallScope) -> Choice:
        """The cheapest tier that meets the time ``scope`` has left."""
        left = (math.inf if scope.deadline is None
                else scope.deadline - self._clock())
        standard = self._need(STANDARD)
        if (scope.priority != Priority.INTERACTIVE and "flex" in self.policy.tiers
                and left >= self._need("flex") + standard):
            return Choice("flex", cutoff=(None if scope.deadline is None
                                          else scope.deadline - standard))
        # The premium only where the standard tier, as measured, would miss (its latency
        # without the margin: with it, the standard would still have answered in time) and
        # priority, with the margin, would not: a priority no faster is never paid for.
        if (self.policy.allows_priority(scope.tenant_id) and self._standard_misses(left)
                and left >= self._need("priority")):
            return Choice("priority")
        return Choice(None)

    async def call(self, send: Callable[[], Awaitable[ModelReply]],
                   scope: CallScope) -> ModelReply:
        """``send`` at the chosen tier; a flex call refused for capacity or past its cut-off
        sent again at once at the standard tier (the same attempt, the same reservation)."""
        choice = self.choose(scope)
        left = None if scope.deadline is None else scope.deadline - self._clock()
        if choice.tier != "flex":
            reply = await self._timed(send, choice.tier)
            self._record(choice.tier, reply, None, None, left)
            return reply
        try:
            async with asyncio.timeout(None if choice.cutoff is None
                                       else max(0.0, choice.cutoff - self._clock())):
                reply = await self._timed(send, "flex")
        except StepFailure as exc:
            if exc.code != FLEX_REFUSED:
                raise
            moved = "flex_refused"
        except TimeoutError:
            moved = "flex_late"
        else:
            self._record("flex", reply, None, None, left)
            return reply
        moved_at = time.monotonic()
        reply = await self._timed(send, None)
        self._record("flex", reply, moved, time.monotonic() - moved_at, left)
        return reply

    async def _timed(self, send: Callable[[], Awaitable[ModelReply]],
                     tier: str | None) -> ModelReply:
        """``send`` asking ``tier`` (the wire reads it from SERVICE_TIER); its latency is
        measured under the tier that served it."""
        token = SERVICE_TIER.set(tier)
        started = time.monotonic()
        try:
            reply = await send()
        finally:
            SERVICE_TIER.reset(token)
        self.latencies.observe(self.provider, self.model, served_tier(reply, tier),
                               time.monotonic() - started)
        return reply

    def _record(self, chosen: str | None, reply: ModelReply, moved: str | None,
                moved_seconds: float | None, left: float | None) -> None:
        served = served_tier(reply, None if moved else chosen)
        _calls().labels(self.provider, self.model, chosen or STANDARD, served,
                        moved or "none").inc()
        clock = current_clock()
        if clock is None:
            return
        entry: dict[str, Any] = {"model": self.model, "chosen": chosen or STANDARD,
                                 "served": served}
        if left is not None:  # the time the call had when its tier was chosen
            entry["left_s"] = round(left, 3)
        if moved is not None:
            entry["moved"] = moved
            entry["moved_ms"] = round((moved_seconds or 0.0) * 1000, 1)
        clock.tiers.append(entry)


def served_tier(reply: ModelReply, asked: str | None) -> str:
    """The tier that served a call, as calmq names it: the provider's answer (OpenAI's
    ``default`` is the standard tier), else the one asked."""
    named = reply.service_tier or asked or STANDARD
    return STANDARD if named in ("default", "auto", "standard_only") else named


def priced_tiers(prices: Mapping[str, ModelPrice], provider: str, model: str,
                 tiers: Iterable[str], *, table: bool) -> tuple[frozenset[str], list[str]]:
    """Of ``tiers``, those ``model`` has a price for, and the refusals of the rest."""
    kept, refused = set(), []
    for tier in tiers:
        try:
            tier_price(prices, provider, model, tier, table=table)
        except ConfigError as exc:
            refused.append(exc.message)
        else:
            kept.add(tier)
    return frozenset(kept), refused


def chooser_for(settings: Settings, provider: str, model: str,
                latencies: Latencies | None = None) -> TierChooser | None:
    """The chooser of ``model``'s calls, or None when no tier may be asked for it (none
    enabled, another provider than OpenAI, or none priced: a warning names the last)."""
    policy = TierPolicy.from_settings(settings)
    if not policy.tiers or provider != "openai":
        return None
    kept, refused = priced_tiers(settings.prices, provider, model, policy.tiers,
                                 table=settings.prices_table)
    for message in refused:
        log.warning("model %s is sent at the standard tier instead: %s", model, message)
    if not kept:
        return None
    return TierChooser(TierPolicy(kept, policy.priority_tenants, policy.flex_seconds,
                                  policy.standard_seconds, policy.margin),
                       provider, model, latencies=latencies)
