"""Prices per service tier and for cached input, from the genai-prices table."""

from __future__ import annotations

import pytest
from genai_prices import Usage, calc_price

from calmq.calls.pricing import DEFAULT_PRICES, cost_usd, price_for, tier_price
from calmq.errors import ConfigError


def table(model: str, tier: str | None, **tokens: int) -> float:
    """The table's own bill of a call, computed by genai-prices directly."""
    context = {"service_tier": tier} if tier else None
    return float(calc_price(Usage(**tokens), model, provider_id="openai",
                            price_context=context).total_price)


def test_a_call_is_priced_at_the_tier_that_served_it() -> None:
    """The served tier picks the table's price: flex below and priority above the standard
    price of the same tokens; default and auto are the standard price."""
    standard = cost_usd({}, "openai", "gpt-5-mini", 1000, 500)
    assert standard == pytest.approx(table("gpt-5-mini", None, input_tokens=1000,
                                           output_tokens=500))
    for served in ("default", "auto"):
        assert cost_usd({}, "openai", "gpt-5-mini", 1000, 500,
                        service_tier=served) == pytest.approx(standard)
    flex = cost_usd({}, "openai", "gpt-5-mini", 1000, 500, service_tier="flex",
                    requested_tier="flex")
    priority = cost_usd({}, "openai", "gpt-5-mini", 1000, 500, service_tier="priority",
                        requested_tier="fast")
    assert flex == pytest.approx(table("gpt-5-mini", "flex", input_tokens=1000,
                                       output_tokens=500))
    assert priority == pytest.approx(table("gpt-5-mini", "priority", input_tokens=1000,
                                           output_tokens=500))
    assert flex < standard < priority


def test_cached_input_is_priced_at_the_tiers_cached_price() -> None:
    """Cached input tokens cost the cached price of the serving tier, below the input's."""
    cost = cost_usd({}, "openai", "gpt-5-mini", 2000, 100, cached_input_tokens=1920,
                    service_tier="flex", requested_tier="flex")
    assert cost == pytest.approx(table("gpt-5-mini", "flex", input_tokens=2000,
                                       cache_read_tokens=1920, output_tokens=100))
    assert cost < cost_usd({}, "openai", "gpt-5-mini", 2000, 100, service_tier="flex")


def test_a_requested_tier_without_a_known_price_is_refused() -> None:
    """A tier asked for and served that the table has no price for (gpt-4o-mini has no flex
    price; CALMQ_PRICES has no tier columns) is refused with unpriced_tier, not priced at
    the standard price or at 0; served at the standard tier it is priced as usual."""
    for prices, model in (({}, "gpt-4o-mini"), (DEFAULT_PRICES, "fake-small")):
        with pytest.raises(ConfigError) as refused:
            cost_usd(prices, "openai", model, 1000, 100, service_tier="flex",
                     requested_tier="flex")
        assert refused.value.code == "unpriced_tier"
        assert "'flex'" in str(refused.value)
        assert repr(model) in str(refused.value)
        with pytest.raises(ConfigError):
            tier_price(prices, "openai", model, "flex")
        standard = cost_usd(prices, "openai", model, 1000, 100)
        assert standard > 0
        assert cost_usd(prices, "openai", model, 1000, 100, service_tier="default",
                        requested_tier="flex") == pytest.approx(standard)
    with pytest.raises(ConfigError):
        tier_price({}, "openai", "gpt-5-mini", "flex", table=False)


def test_calls_without_a_requested_tier_are_priced_as_before() -> None:
    """No tier asked for: a served tier the table lacks is priced at the standard price (as
    before tiers were refused), and an unknown model still costs 0."""
    standard = cost_usd({}, "openai", "gpt-4o-mini", 1000, 100)
    assert cost_usd({}, "openai", "gpt-4o-mini", 1000, 100,
                    service_tier="flex") == pytest.approx(standard)
    assert cost_usd({}, "openai", "no-such-model", 1000, 100, service_tier="flex") == 0.0
    assert tier_price({}, "openai", "gpt-4o-mini", "default") == price_for(
        {}, "openai", "gpt-4o-mini")
