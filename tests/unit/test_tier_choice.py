"""When calmq pays the premium tier (calmq.calls.tiers, issue 46): only where the standard
tier, as measured, would miss the time left. Not on the settings' estimate of a standard
tier that has not answered yet, and not within the margin, where the standard would still
have answered in time. And a tier without a price of its own is refused by the settings."""

from __future__ import annotations

import json
import time

import pytest

from calmq.calls.pricing import tier_price
from calmq.calls.tiers import TierChooser, TierPolicy
from calmq.calls.wires import CallScope
from calmq.errors import ConfigError
from calmq.settings import Settings

MODEL = "gpt-5-mini"
# The shipped defaults: the standard tier assumed to take 60 s before it has answered.
PRIORITY = TierPolicy(frozenset({"flex", "priority"}), margin=1.5)


def _interactive(left: float) -> CallScope:
    return CallScope("job", "t1", "wf", "interactive", deadline=time.time() + left)


def _observe(chooser: TierChooser, tier: str, seconds: float, n: int = 10) -> None:
    for _ in range(n):
        chooser.latencies.observe("openai", MODEL, tier, seconds)


def test_no_premium_before_the_standard_tier_has_answered() -> None:
    """An interactive call with a step's 60 s left, the standard tier not measured yet: its
    60 s estimate would miss (with the margin, 90 s), but nothing shows it is slow: the
    standard tier, not priority (which, once chosen for every call, kept the standard tier
    from ever being measured)."""
    chooser = TierChooser(PRIORITY, "openai", MODEL)
    assert chooser.choose(_interactive(59.0)).tier is None
    assert chooser.choose(_interactive(0.5)).tier is None
    _observe(chooser, "standard", 1.0)
    assert chooser.choose(_interactive(0.5)).tier == "priority"


def test_no_premium_where_the_standard_meets_the_time_left_within_the_margin() -> None:
    """The standard tier measured at 1 s: with 1.2 s left it would answer in time (the
    margin's 1.5 s is a safety on the tier chosen, not a reason to pay for another); with
    0.8 s left it would miss, and priority measured at 0.2 s (0.3 s with the margin) is
    chosen."""
    chooser = TierChooser(PRIORITY, "openai", MODEL)
    _observe(chooser, "standard", 1.0)
    _observe(chooser, "priority", 0.2)
    assert chooser.choose(_interactive(1.2)).tier is None
    assert chooser.choose(_interactive(0.8)).tier == "priority"
    # Priority measured as slow as the standard: it would miss too, and is not paid for.
    _observe(chooser, "priority", 1.0, n=64)
    assert chooser.choose(_interactive(0.8)).tier is None


def test_a_tier_without_a_price_of_its_own_is_refused_when_configured() -> None:
    """"Unpriced tiers are refused when the tier is configured, not priced at 0": with the
    price table off, CALMQ_PRICES' standard price of the model is no price for flex (it has
    no tier columns), so the settings refuse the tier instead of billing it at the standard
    price or 0; with the table on, its flex price is taken."""
    prices = json.dumps({MODEL: {"input": 0.25, "output": 2.0}})
    environ = {"CALMQ_SERVICE_TIERS": "flex", "CALMQ_MODEL": MODEL, "CALMQ_PRICES": prices,
               "CALMQ_PRICES_TABLE": "false"}
    with pytest.raises(ConfigError, match="service tier 'flex' of model 'gpt-5-mini'"):
        Settings.load(environ=environ)
    settings = Settings.load(environ={**environ, "CALMQ_PRICES_TABLE": "true"})
    assert settings.service_tier_list == ["flex"]
    flex = tier_price(settings.prices, "openai", MODEL, "flex")
    assert flex is not None
    assert 0 < flex.input < 0.25
