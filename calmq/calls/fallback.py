"""Fallback across models: a step's ordered list of allowed models (``Step.models``), each
call served by the first one that is not cooling down or blocked.

A 429 cools down exactly what it names, fleet-wide: the endpoint, the model and the API key
(calmq.calls.gate.provider_key; every worker hears of it on ``LISTEN calmq_providers``). A
step that allows another model moves to it at once, in the same attempt: the 429 burned
no attempt, and nothing waits on the cooling model. When every allowed model cools, the
call is not made and the attempt is not counted (``ModelsCooling``): the pipeline hands the
job back to wait in ``queued`` (``waiting_reason`` ``model_cooldown``) until the earliest
cooldown ends, and a release pass re-publishes it (calmq.data.cooldowns).

A model outside the step's list never serves it, and a price ceiling
(``Step.max_price_per_mtok``) keeps a dearer or unpriced model out of the list when the
worker starts (``allowed_models``). The model that served is what the meter records: on the
attempt (``job_attempts.model``), in the result event's usage and in the cost (its price).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from calmq.calls.pricing import ModelPrice, price_for
from calmq.calls.wires import ModelReply, ModelStream
from calmq.errors import ConfigError, StepFailure
from calmq.failure_codes import ModelsCooling, ProviderBlocked

if TYPE_CHECKING:
    from calmq.calls.budgeted_provider import BudgetedProvider

__all__ = ["Fallback", "allowed_models"]

log = logging.getLogger(__name__)


@cache
def _fallbacks() -> Counter:
    return Counter("calmq_model_fallbacks_total", "Model calls a step's next allowed model "
                   "served because the first choice was cooling down or blocked",
                   ["from_model", "to_model"])


def allowed_models(models: Sequence[str], ceiling: float | None, *, default: str,
                   prices: Mapping[str, ModelPrice], provider: str,
                   table: bool = True) -> list[str]:
    """The models a step may call, in its order: ``models`` (empty: ``default`` alone),
    without those priced above ``ceiling`` (USD per million input or output tokens) or
    without a price when there is a ceiling. ConfigError when none is left."""
    wanted = list(models) or [default]
    if ceiling is None:
        return wanted
    kept = []
    for model in wanted:
        price = price_for(prices, provider, model, table=table)
        if price is not None and max(price.input, price.output) <= ceiling:
            kept.append(model)
    if not kept:
        raise ConfigError(f"no model of {wanted} is priced at or under {ceiling:g} USD per "
                         "million tokens (CALMQ_PRICES or the price table)")
    return kept


class Fallback:
    """The provider a step with several allowed models sees (see the module)."""

    def __init__(self, choices: Sequence[BudgetedProvider]) -> None:
        if not choices:
            raise ValueError("a fallback needs at least one model")
        self.choices = list(choices)

    @property
    def model(self) -> str:
        return self.choices[0].model

    def _usable(self) -> list[BudgetedProvider]:
        return [p for p in self.choices
                if p.gate is None or (p.gate.blocked is None and not p.gate.cooling_seconds())]

    def _refusal(self, last: StepFailure | None = None) -> StepFailure:
        """None usable: cooling (wait for the earliest), or every one blocked; else (no
        gate said why: a provider without one) the last call's own failure."""
        cooling = [p.gate.cooling_seconds() for p in self.choices
                   if p.gate is not None and p.gate.blocked is None]
        cooling = [s for s in cooling if s > 0]
        if cooling:
            return ModelsCooling(min(cooling), [p.model for p in self.choices])
        first = self.choices[0]
        if first.gate is not None and first.gate.blocked is not None:
            return first.gate.refusal()
        return last or ModelsCooling(1.0, [p.model for p in self.choices])

    def _served(self, served: BudgetedProvider) -> None:
        first = self.choices[0]
        if served is not first:
            _fallbacks().labels(first.model, served.model).inc()

    async def complete(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                       response_schema: dict[str, Any] | None = None) -> ModelReply:
        last: StepFailure | None = None
        for choice in self.choices:
            if choice not in self._usable():  # read again: a 429 a moment ago counts
                continue
            try:
                reply = await choice.complete(messages=messages, job_id=job_id,
                                              max_tokens=max_tokens,
                                              response_schema=response_schema,
                                              wait_for_cooldown=False)
            except (ProviderBlocked, ModelsCooling) as exc:
                last = exc  # blocked or cooling fleet-wide now (its gate says so): the next
                continue
            except StepFailure as exc:
                if exc.code != "rate_limited":
                    raise
                # The 429 paused this model fleet-wide (BudgetedProvider): the next one.
                log.info("model %s answered 429; trying the step's next allowed model",
                         choice.model)
                last = exc
                continue
            self._served(choice)
            return reply
        raise self._refusal(last)

    def stream(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
               response_schema: dict[str, Any] | None = None) -> ModelStream:
        """A streamed call on the first allowed model not cooling (a stream does not move
        to another model once it began: its text reached the job's followers)."""
        usable = self._usable()
        if not usable:
            raise self._refusal()
        self._served(usable[0])
        return usable[0].stream(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                response_schema=response_schema, wait_for_cooldown=False)

    async def embed(self, *, inputs: list[str], job_id: str) -> Any:
        return await self.choices[0].embed(inputs=inputs, job_id=job_id)

    async def close(self) -> None:
        return None  # the worker's providers are the worker's to close
