"""Model prices: what a call cost, from the tokens the provider reported.

Prices are a setting (``CALMQ_PRICES``, JSON): model name -> USD per million input and
output tokens. A ``provider:model`` key wins over a bare ``model`` key, for the same model
name served at two prices. A model without a price costs 0 and is reported once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BATCH_DISCOUNT", "DEFAULT_PRICES", "ModelPrice", "batch_cost_usd", "cost_usd",
           "price_for"]

log = logging.getLogger(__name__)


class ModelPrice(BaseModel):
    """USD per million tokens, as providers publish them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: float = Field(ge=0)
    output: float = Field(ge=0)
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

_unpriced: set[str] = set()


def price_for(prices: Mapping[str, ModelPrice], provider: str, model: str) -> ModelPrice | None:
    return prices.get(f"{provider}:{model}") or prices.get(model)


def cost_usd(
    prices: Mapping[str, ModelPrice], provider: str, model: str, input_tokens: int,
    output_tokens: int,
) -> float:
    """The cost of one call in USD; 0 for a model without a price."""
    price = price_for(prices, provider, model)
    if price is None:
        if model not in _unpriced:
            _unpriced.add(model)
            log.warning("no price for model %r (provider %s): its calls are costed at 0; "
                        "add it to CALMQ_PRICES", model, provider)
        return 0.0
    return (input_tokens * price.input + output_tokens * price.output) / 1_000_000


def batch_cost_usd(
    prices: Mapping[str, ModelPrice], provider: str, model: str, input_tokens: int,
    output_tokens: int,
) -> float:
    """The cost of one request of a provider batch in USD, at the price's batch column."""
    price = price_for(prices, provider, model)
    if price is None:
        return cost_usd(prices, provider, model, input_tokens, output_tokens)  # 0, logged
    batch_in = price.batch_input if price.batch_input is not None else (
        price.input * BATCH_DISCOUNT)
    batch_out = price.batch_output if price.batch_output is not None else (
        price.output * BATCH_DISCOUNT)
    return (input_tokens * batch_in + output_tokens * batch_out) / 1_000_000
