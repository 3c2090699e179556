"""Numbers that are not finite (``1e999``, which Python's JSON parser reads as infinity, and
NaN/Infinity): refused where JSON from outside is read, since jsonb cannot hold them."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from calmq.calls.output_schemas import read_answer
from calmq.errors import ContractError, FailureClass, StepFailure
from calmq.producers.parsing import parse_json
from calmq.storable import NonFiniteNumber, loads, non_finite, unstorable
from calmq.workflows import Step, StepContext, StepOutput


class Scored(BaseModel):
    score: float


async def _noop(_ctx: StepContext, _data: dict[str, Any]) -> StepOutput:
    return StepOutput(artifact={})


@pytest.mark.parametrize("text", ["1e999", "[1, -1E400]", '{"a": {"b": NaN}}', "Infinity"])
def test_loads_refuses_numbers_that_are_not_finite(text: str) -> None:
    """storable.loads raises NonFiniteNumber (a ValueError) where json.loads gives inf."""
    with pytest.raises(NonFiniteNumber):
        loads(text)
    assert loads('{"a": 1.5, "b": 10}') == {"a": 1.5, "b": 10}


def test_a_body_with_1e999_is_400_non_finite_number() -> None:
    """The API's parser answers 400 non_finite_number for 1e999, invalid_json for NaN."""
    with pytest.raises(ContractError) as caught:
        parse_json(b'{"metadata": {"n": 1e999}}')
    assert (caught.value.status, caught.value.code) == (400, "non_finite_number")
    with pytest.raises(ContractError) as nan:
        parse_json(b'{"n": NaN}', "field metadata")
    assert (nan.value.status, nan.value.code) == (400, "invalid_json")
    assert nan.value.message.startswith("field metadata")


def test_a_models_answer_with_1e999_does_not_read() -> None:
    """read_answer refuses 1e999 for a float field (the steps call that malformed_output)."""
    with pytest.raises(ValueError, match="double-precision"):
        read_answer(Scored, '{"score": 1e999}')
    assert read_answer(Scored, '{"score": 0.5}').score == 0.5


@pytest.mark.parametrize("model", [None, Scored])
def test_an_output_with_infinity_is_malformed_output(model: type[BaseModel] | None) -> None:
    """check_output (a step's output, a reviewer's corrected fields) refuses infinity with
    or without an output model: class verifier, code malformed_output."""
    step = Step("score", _noop, output_model=model)
    with pytest.raises(StepFailure) as caught:
        step.check_output({"score": float("inf")})
    assert (caught.value.code, caught.value.failure_class) == (
        "malformed_output", FailureClass.VERIFIER)
    assert step.check_output({"score": 0.5}) == {"score": 0.5}


def test_unstorable_names_a_number_that_is_not_finite() -> None:
    """The worker's last check before a commit names the place of a NaN or infinity."""
    assert unstorable({"a": [1.0, float("nan")]}, "output") == (
        "a number that is not finite in output.a[1]")
    assert non_finite({"a": [{"b": float("-inf")}]}, "input") == "input.a[0].b"
    assert non_finite({"a": [1, 2.5, "x"]}) is None
