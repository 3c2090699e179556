"""Model prices: what a call cost, from the tokens the provider reported.

Prices come from two places, the first that knows the model wins:

1. ``CALMQ_PRICES`` (JSON): model name -> USD per million input and output tokens (and,
   optionally, cached input and the batch column). A ``provider:model`` key wins over a bare
   ``model`` key, for the same model name served at two prices. It is the override.
2. The ``genai-prices`` table (pydantic's maintained database of providers' prices, shipped
   with the package and read offline): every OpenAI and Anthropic model, with the price of
   cached input tokens and of the service tiers (flex, priority). Turned off with
   ``CALMQ_PRICES_TABLE=false``.

Cached input tokens are priced at the cached column (OpenAI's ``cached_tokens``,
Anthropic's cache reads), Anthropic's cache writes at the cache-write column (the table's
``cache_write`` price); reasoning tokens are output tokens (both providers bill them so and
count them in the output); the batch APIs charge ``BATCH_DISCOUNT`` of the online price
unless a batch column is set; the service tier the provider says it served picks the
table's price for that tier. A model neither place prices costs 0, is named by
``calmq provider check`` and in ``unpriced_models()`` (the console's overview reads it), and
logged once.

A tier someone asks for (``requested_tier``: flex, priority, scale, fast) is priced only at
a price known for that tier: the table's conditional price for it (CALMQ_PRICES has no tier
columns). Without one, ``tier_price`` and ``cost_usd`` refuse it (``unpriced_tier``) rather
than bill it at the standard price or at 0. A call that asked for no tier is priced as
before: at the served tier's price where the table has one, else at the standard price.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import cache

from pydantic import BaseModel, ConfigDict, Field

from calmq.errors import ConfigError

__all__ = ["BATCH_DISCOUNT", "DEFAULT_PRICES", "STANDARD_TIERS", "ModelPrice", "batch_cost_usd",
           "cost_usd", "price_for", "price_source", "tier_price", "unpriced_models"]

log = logging.getLogger(__name__)

_MILLION = 1_000_000
_UNIT = 1_000


class ModelPrice(BaseModel):
    """USD per million tokens, as providers publish them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    # Input tokens served from the provider's prompt cache; None: the input price.
    cached_input: float | None = Field(default=None, ge=0)
    # Input tokens written to the prompt cache (Anthropic bills a write at 1.25 times the
    # input price); None: the input price.
    cache_write_input: float | None = Field(default=None, ge=0)
    # The batch APIs' price (the batch column); None: BATCH_DISCOUNT of the online price.
    batch_input: float | None = Field(default=None, ge=0)
    batch_output: float | None = Field(default=None, ge=0)


# What OpenAI's Batch API and Anthropic's Message Batches charge against the online price.
BATCH_DISCOUNT = 0.5


# The fake provider's models are priced like a small hosted model, so the demo and the
# benchmarks show non-zero costs that move the way a real bill would.
DEFAULT_PRICES: dict[str, ModelPrice] = {
    "fake-small": ModelPrice(input=0.15, output=0.60),
    "fake-large": ModelPrice(input=2.50, output=10.00),
}

# The names the providers give the standard tier, asked for or served (OpenAI: auto,
# default; Anthropic: auto, standard_only, standard): the price without a tier.
STANDARD_TIERS = frozenset({"", "auto", "default", "standard", "standard_only"})
# OpenAI answers a ``fast`` request as served ``priority`` (its SDK's service_tier docs).
_TIER_ALIASES = {"fast": "priority"}

_unpriced: set[tuple[str, str]] = set()


def _kind(provider: str) -> str:
    return provider.split(":", 1)[0]


@cache
def _table_price(kind: str, model: str, tier: str | None) -> ModelPrice | None:
    """The genai-prices table's price of ``model`` (None: not in the table, or no table)."""
    provider_id = _table_provider(kind)
    if provider_id is None:
        return None
    try:
        from genai_prices import Usage, calc_price
    except ImportError:  # pragma: no cover - a dependency; only a broken install lacks it
        return None
    context = {"service_tier": tier} if tier else None

    def per_million(**tokens: int) -> float:
        # Priced for a thousand tokens and scaled: a million at once would be priced at the
        # long-context tier some models have (over 200k tokens in one call).
        found = calc_price(Usage(**tokens), model, provider_id=provider_id,
                           price_context=context)
        return float(found.total_price) * (_MILLION // _UNIT)

    try:
        if tier and not _table_has_tier(provider_id, model, tier):
            return None  # the table would price it at the standard price: not known
        full = per_million(input_tokens=_UNIT)
        cached = per_million(input_tokens=_UNIT, cache_read_tokens=_UNIT)
        written = per_million(input_tokens=_UNIT, cache_write_tokens=_UNIT)
        return ModelPrice(input=full, output=per_million(output_tokens=_UNIT),
                          cached_input=cached, cache_write_input=written)
    except (LookupError, ValueError):
        return None


def _table_provider(kind: str) -> str | None:
    """The table's provider id of calmq's provider ``kind``, as its wire declares it (Azure
    OpenAI bills OpenAI's prices); None for a kind no wire has."""
    # Imported here: the settings model reads this module, and must not pull in the HTTP
    # client (calmq.calls' docstring).
    from calmq.calls.wires import WIRES

    found = WIRES.get(kind)
    return found.price_table if found is not None else None


def _table_has_tier(provider_id: str, model: str, tier: str) -> bool:
    """Whether the table has a conditional price of ``model`` for ``tier`` (a price variant
    ``when={"service_tier": tier}``); the table prices an unknown tier as the standard."""
    from genai_prices import Usage, calc_price

    info = calc_price(Usage(input_tokens=_UNIT), model, provider_id=provider_id).model
    return any(variant.when.get("service_tier") == tier
               for variant in info.price_variants or ())


def _named_tier(tier: str | None) -> str | None:
    """The tier as the table names it; None for the standard tier."""
    if tier is None or tier in STANDARD_TIERS:
        return None
    return _TIER_ALIASES.get(tier, tier)


def tier_price(prices: Mapping[str, ModelPrice], provider: str, model: str,
               tier: str | None, *, table: bool = True) -> ModelPrice | None:
    """The price of ``model`` at ``tier`` exactly: for the standard tier ``price_for``'s
    (None: unpriced); for another tier the table's price for it, or ConfigError
    ``unpriced_tier`` when none is known (a tier someone asks for is not priced at the
    standard price, nor at 0)."""
    named = _named_tier(tier)
    if named is None:
        return price_for(prices, provider, model, table=table)
    found = _table_price(_kind(provider), model, named) if table else None
    if found is None:
        raise ConfigError(
            f"no price for service tier {tier!r} of model {model!r} (provider "
            f"{_kind(provider)}): genai-prices has none for it"
            + ("" if table else " and CALMQ_PRICES_TABLE is off")
            + "; ask for the standard tier, or a model priced at that tier",
            code="unpriced_tier")
    return found


def price_for(prices: Mapping[str, ModelPrice], provider: str, model: str,
              service_tier: str | None = None, *, table: bool = True) -> ModelPrice | None:
    """The price of ``model``: CALMQ_PRICES first, then the table (None: unpriced)."""
    kind = _kind(provider)
    found = prices.get(f"{kind}:{model}") or prices.get(model)
    if found is not None:
        return found
    if not table:
        return None
    tier = _named_tier(service_tier)
    return _table_price(kind, model, tier) or (_table_price(kind, model, None) if tier
                                               else None)


def price_source(prices: Mapping[str, ModelPrice], provider: str, model: str, *,
                 table: bool = True) -> str:
    """Where the price of ``model`` comes from: ``CALMQ_PRICES``, ``genai-prices`` or
    ``none``."""
    kind = _kind(provider)
    if prices.get(f"{kind}:{model}") or prices.get(model):
        return "CALMQ_PRICES"
    if table and _table_price(kind, model, None) is not None:
        return "genai-prices"
    return "none"


def unpriced_models() -> list[tuple[str, str]]:
    """(provider kind, model) of every model this process called without a price: for the
    console's overview and ``calmq provider check``."""
    return sorted(_unpriced)


def _missing(provider: str, model: str) -> float:
    key = (_kind(provider), model)
    if key not in _unpriced:
        _unpriced.add(key)
        log.warning("no price for model %r (provider %s): its calls are costed at 0; add it "
                    "to CALMQ_PRICES", model, key[0])
    return 0.0


def cost_usd(
    prices: Mapping[str, ModelPrice], provider: str, model: str, input_tokens: int,
    output_tokens: int, *, cached_input_tokens: int = 0, service_tier: str | None = None,
    requested_tier: str | None = None, table: bool = True, cache_write_tokens: int = 0,
) -> float:
    """The cost of one call in USD at the tier that served it (``service_tier``, from the
    answer); 0 for a model without a price. ``input_tokens`` includes the cached ones and
    those written to the cache (``cache_write_tokens``, at the cache-write price);
    ``output_tokens`` includes reasoning tokens. When the call asked for a tier
    (``requested_tier``) and was served at one other than the standard, that tier's price
    must be known: ConfigError ``unpriced_tier`` otherwise."""
    if _named_tier(requested_tier) is not None and _named_tier(service_tier) is not None:
        price = tier_price(prices, provider, model, service_tier, table=table)
    else:
        price = price_for(prices, provider, model, service_tier, table=table)
    if price is None:
        return _missing(provider, model)
    cached = min(max(0, cached_input_tokens), input_tokens)
    written = min(max(0, cache_write_tokens), input_tokens - cached)
    cached_price = price.cached_input if price.cached_input is not None else price.input
    write_price = price.cache_write_input if price.cache_write_input is not None \
        else price.input
    return ((input_tokens - cached - written) * price.input + cached * cached_price
            + written * write_price + output_tokens * price.output) / _MILLION


def batch_cost_usd(
    prices: Mapping[str, ModelPrice], provider: str, model: str, input_tokens: int,
    output_tokens: int, *, cached_input_tokens: int = 0, table: bool = True,
) -> float:
    """The cost of one request of a provider batch in USD, at the price's batch column."""
    price = price_for(prices, provider, model, table=table)
    if price is None:
        return _missing(provider, model)
    batch_in = price.batch_input if price.batch_input is not None else (
        price.input * BATCH_DISCOUNT)
    batch_out = price.batch_output if price.batch_output is not None else (
        price.output * BATCH_DISCOUNT)
    cached = min(max(0, cached_input_tokens), input_tokens)
    cached_in = (price.cached_input * BATCH_DISCOUNT if price.cached_input is not None
                 and price.batch_input is None else batch_in)
    return ((input_tokens - cached) * batch_in + cached * cached_in
            + output_tokens * batch_out) / _MILLION
