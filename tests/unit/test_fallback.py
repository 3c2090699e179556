"""Fallback across a step's allowed models (calmq.calls.fallback), on the real BudgetedProvider and
ProviderGate (no ledger: one process), with scripted inner providers and a hand-set clock."""

from __future__ import annotations

from typing import Any

import pytest

from calmq.calls.budgeted_provider import BudgetedProvider
from calmq.calls.fallback import Fallback, allowed_models
from calmq.calls.gate import ProviderGate, provider_key
from calmq.calls.pricing import ModelPrice
from calmq.calls.wires import ModelReply, model_clock
from calmq.errors import ConfigError, FailureClass, StepFailure
from calmq.failure_codes import ModelsCooling
from calmq.workflows import Step, StepContext, StepOutput
from tests.support.scripted import ScriptedProvider

MESSAGES = [{"role": "user", "content": "hello"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _reply(text: str) -> ModelReply:
    return ModelReply(content=text, refusal=None, input_tokens=10, output_tokens=5)


def _limited(seconds: float) -> StepFailure:
    return StepFailure("Rate limit reached", code="rate_limited",
                       failure_class=FailureClass.TRANSIENT, retry_after=seconds)


def _model(name: str, inner: ScriptedProvider, clock: Clock) -> BudgetedProvider:
    prices = {"fast": ModelPrice(input=0.1, output=0.4), "slow": ModelPrice(input=1, output=4)}
    return BudgetedProvider(inner, provider="openai", model=name, prices=prices,
                            gate=ProviderGate("openai:x", name, clock=clock),
                            prices_table=False)


async def _call(fallback: Fallback) -> ModelReply:
    return await fallback.complete(messages=MESSAGES, job_id="j1", max_tokens=16)


async def test_the_first_allowed_model_serves_and_is_what_the_meter_records() -> None:
    clock = Clock()
    first, second = ScriptedProvider(_reply("a")), ScriptedProvider()
    fallback = Fallback([_model("fast", first, clock), _model("slow", second, clock)])
    meter = model_clock()
    assert (await _call(fallback)).content == "a"
    assert (first.calls, second.calls) == (1, 0)
    assert meter.model == "fast"
    assert meter.cost_usd == pytest.approx((10 * 0.1 + 5 * 0.4) / 1e6)


async def test_a_429_moves_the_same_call_to_the_next_model_and_cools_the_first() -> None:
    """The 429 burns no attempt: the call is served by the next model at once, its price
    is what the call costs, and later calls skip the cooling model until Retry-After."""
    clock = Clock()
    first = ScriptedProvider(_limited(30), _reply("a again"))
    second = ScriptedProvider(_reply("b"), _reply("b2"))
    fast, slow = _model("fast", first, clock), _model("slow", second, clock)
    fallback = Fallback([fast, slow])
    meter = model_clock()
    assert (await _call(fallback)).content == "b"
    assert meter.model == "slow"
    assert meter.cost_usd == pytest.approx((10 * 1 + 5 * 4) / 1e6)  # the served model's
    assert fast.gate is not None
    assert fast.gate.cooling_seconds() == pytest.approx(30)
    assert (await _call(fallback)).content == "b2"
    assert first.calls == 1  # not called while it cools
    clock.now += 30.5
    assert (await _call(fallback)).content == "a again"  # back to the first choice
    assert first.calls == 2


async def test_every_model_cooling_makes_no_call_and_says_how_long_to_wait() -> None:
    clock = Clock()
    first, second = ScriptedProvider(_limited(30)), ScriptedProvider(_limited(12))
    fallback = Fallback([_model("fast", first, clock), _model("slow", second, clock)])
    with pytest.raises(ModelsCooling) as cooling:
        await _call(fallback)
    assert cooling.value.seconds == pytest.approx(12)  # the earliest cooldown's end
    assert cooling.value.models == ("fast", "slow")
    with pytest.raises(ModelsCooling):
        await _call(fallback)
    assert (first.calls, second.calls) == (1, 1)  # the second refusal called nobody
    clock.now += 13
    second.answers.append(_reply("b"))
    assert (await _call(fallback)).content == "b"


async def test_a_failure_that_is_not_a_rate_limit_is_the_calls_own() -> None:
    clock = Clock()
    broken = StepFailure("server error", code="provider_error",
                         failure_class=FailureClass.TRANSIENT)
    first, second = ScriptedProvider(broken), ScriptedProvider(_reply("b"))
    fallback = Fallback([_model("fast", first, clock), _model("slow", second, clock)])
    with pytest.raises(StepFailure) as raised:
        await _call(fallback)
    assert raised.value.code == "provider_error"
    assert second.calls == 0


async def test_a_step_alone_reads_every_model_cooling_as_a_rate_limit() -> None:
    """Outside a worker (a step tested alone) the refusal is the 429 it stands for."""
    clock = Clock()
    fallback = Fallback([_model("fast", ScriptedProvider(_limited(5)), clock)])

    async def run(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
        await ctx.provider.complete(messages=MESSAGES, job_id=ctx.job_id, max_tokens=16)
        return StepOutput({})

    ctx = StepContext("j1", "t1", "s", 1, fallback)
    with pytest.raises(StepFailure) as raised:
        await run(ctx, {})
    assert (raised.value.code, raised.value.retry_after) == ("rate_limited", 5)


def test_a_price_ceiling_keeps_dearer_and_unpriced_models_out_in_order() -> None:
    prices = {"fast": ModelPrice(input=0.1, output=0.4), "slow": ModelPrice(input=1, output=4),
              "cheap": ModelPrice(input=0.05, output=0.2)}
    kept = allowed_models(["slow", "fast", "unpriced", "cheap"], 1.0, default="x",
                          prices=prices, provider="openai", table=False)
    assert kept == ["fast", "cheap"]
    assert allowed_models([], None, default="x", prices=prices, provider="openai") == ["x"]
    with pytest.raises(ConfigError, match=r"priced at or under 0\.01"):
        allowed_models(["slow"], 0.01, default="x", prices=prices, provider="openai",
                       table=False)


@pytest.mark.parametrize("models", [("a", "a"), ("",), (" a",)])
def test_a_step_refuses_models_it_cannot_name(models: tuple[str, ...]) -> None:
    async def run(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
        return StepOutput({})

    with pytest.raises(ValueError, match="models are distinct"):
        Step("s", run, models=models)


def test_a_cooldown_names_the_api_key_not_only_the_endpoint() -> None:
    one = provider_key("openai", "https://api.openai.com/v1/", "sk-one")
    assert one.startswith("openai:https://api.openai.com/v1#key-")
    assert "sk-one" not in one
    assert one != provider_key("openai", "https://api.openai.com/v1", "sk-two")
    assert provider_key("openai", "http://x/", "") == "openai:http://x"
