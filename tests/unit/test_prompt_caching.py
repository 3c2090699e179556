"""Prompt caching (calmq.calls.caching): the stable prefix a step marks, the key per workflow
and tenant, the price of cache reads and writes, and what the cache saved."""

from __future__ import annotations

import pytest

from calmq.calls.caching import (
    anthropic_prompt,
    cache_key,
    cache_use,
    openai_prompt,
    prefix_length,
    stable,
)
from calmq.calls.pricing import ModelPrice, cost_usd, price_for

SYSTEM = {"role": "system", "content": "Rules."}
DOC = {"role": "user", "content": "A long document."}
ASK = {"role": "user", "content": "A question."}


def test_the_prefix_ends_at_the_last_marked_message() -> None:
    """Every message up to the last mark is the prefix; no mark, no prefix."""
    assert prefix_length([SYSTEM, DOC, ASK]) == 0
    assert prefix_length([stable(SYSTEM), DOC, ASK]) == 1
    assert prefix_length([stable(SYSTEM), stable(DOC), ASK]) == 2
    assert prefix_length([SYSTEM, stable(DOC), ASK]) == 2


def test_the_cache_key_is_per_workflow_and_tenant_and_names_neither() -> None:
    """Stable for a workflow and tenant, another for another of either, and a hash."""
    key = cache_key("handbook", "tenant-a")
    assert key == cache_key("handbook", "tenant-a")
    assert key != cache_key("handbook", "tenant-b")
    assert key != cache_key("other", "tenant-a")
    assert "tenant" not in key
    assert "handbook" not in key
    assert len(key) <= 64  # OpenAI's limit for the key


def test_openai_without_a_mark_is_sent_as_before() -> None:
    """No mark: the same messages object, and no cache parameter."""
    messages = [SYSTEM, ASK]
    assert openai_prompt(messages, "w", "t") == (messages, {})
    bare, extra = openai_prompt([stable(SYSTEM), ASK], "w", "t")
    assert bare == [SYSTEM, ASK]
    assert extra == {"prompt_cache_key": cache_key("w", "t")}


def test_anthropic_marks_the_last_block_of_the_prefix() -> None:
    """A marked system prompt becomes text blocks, the mark on the marked one's; a marked
    user message becomes one block with the mark; without a mark, as before."""
    assert anthropic_prompt([SYSTEM, ASK]) == ("Rules.", [ASK])
    system, rest = anthropic_prompt([stable(SYSTEM), {"role": "system", "content": "More."},
                                     ASK])
    assert system == [{"type": "text", "text": "Rules.",
                       "cache_control": {"type": "ephemeral"}},
                      {"type": "text", "text": "More."}]
    assert rest == [ASK]
    system, rest = anthropic_prompt([SYSTEM, stable(DOC), ASK])
    assert system == "Rules."
    assert rest == [{"role": "user", "content": [{
        "type": "text", "text": "A long document.", "cache_control": {"type": "ephemeral"}}]},
        ASK]


def test_cache_writes_are_priced_at_the_tables_write_price() -> None:
    """Anthropic: a write at 1.25 times the input price, a read at a tenth (genai-prices);
    a price without a write column bills a write at the input price."""
    price = price_for({}, "anthropic", "claude-sonnet-4-5")
    assert price is not None
    assert price.cache_write_input == pytest.approx(price.input * 1.25)
    written = cost_usd({}, "anthropic", "claude-sonnet-4-5", 5000, 0, cache_write_tokens=4000)
    assert written == pytest.approx((1000 * price.input + 4000 * price.input * 1.25) / 1e6)
    own = {"m": ModelPrice(input=1.0, output=2.0, cached_input=0.5)}
    assert cost_usd(own, "openai", "m", 1000, 0, cache_write_tokens=800) == pytest.approx(
        1000 / 1e6)


def test_what_the_cache_saved_is_net_of_the_writes_premium() -> None:
    """Reads save the input price less the cached price; writes cost their premium."""
    prices = {"m": ModelPrice(input=4.0, output=0.0, cached_input=0.4,
                              cache_write_input=5.0)}

    def price(read: int, written: int) -> float:
        return cost_usd(prices, "anthropic", "m", 10_000, 0, cached_input_tokens=read,
                        cache_write_tokens=written)

    first = cache_use(price, 0, 8_000)
    assert first.write_extra_usd == pytest.approx(8_000 * 1.0 / 1e6)
    assert first.saved_usd == pytest.approx(-0.008)
    later = cache_use(price, 8_000, 0)
    assert later.read_saved_usd == pytest.approx(8_000 * 3.6 / 1e6)
    assert later.saved_usd == pytest.approx(0.0288)
    assert cache_use(price, 0, 0).saved_usd == 0.0
