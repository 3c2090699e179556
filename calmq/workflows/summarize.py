"""The built-in ``summarize`` workflow: one model step, artifact ``{"summary": str}``."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from calmq.calls.output_schemas import read_answer
from calmq.errors import FailureClass, StepFailure
from calmq.workflows import ByReference, Step, StepContext, StepOutput, Workflow

__all__ = ["SUMMARIZE", "SummarizeInput", "SummaryOutput", "summarize"]


class SummarizeInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(min_length=1, max_length=200_000)
    mode: str | None = Field(default=None, max_length=40)
    # Knobs of the fake provider, passed through to it (see docs/reference/fake-provider.md).
    fail_times: int | None = Field(default=None, ge=0, le=100)
    delay_ms: int | None = Field(default=None, ge=0, le=600_000)


class SummaryOutput(BaseModel):
    """What the model must return; anything else is ``malformed_output``."""

    model_config = ConfigDict(extra="ignore")

    summary: str = Field(min_length=1)
    confidence: float = Field(default=1.0, ge=0, le=1)


@cache
def _output_schema() -> dict[str, Any]:
    # Built once: pydantic's schema generation cost ~0.25 ms of CPU on every model call,
    # about a sixth of a worker's whole CPU per job (bench/results/e2e-profile.md).
    return SummaryOutput.model_json_schema()


_SYSTEM = (
    "Summarize the user's text in one or two sentences. Answer only with JSON: "
    '{"summary": string, "confidence": number between 0 and 1}.'
)


async def summarize(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    reply = await ctx.provider.complete(
        messages=[
            {"role": "system", "content": _SYSTEM},
            {"role": "user", "content": json.dumps(data)},
        ],
        job_id=ctx.job_id,
        max_tokens=256,
        response_schema=_output_schema(),
    )
    if reply.refusal:
        raise StepFailure(f"the model refused: {reply.refusal[:200]}", code="model_refusal",
                          failure_class=FailureClass.POLICY)
    try:
        output = read_answer(SummaryOutput, reply.content or "")
    except (ValidationError, ValueError) as exc:
        raise StepFailure(
            f"model output is not the summary schema: {(reply.content or '')[:120]!r}",
            code="malformed_output", failure_class=FailureClass.VERIFIER,
        ) from exc
    return StepOutput(
        artifact={"summary": output.summary},
        confidence=output.confidence,
        input_tokens=reply.input_tokens,
        output_tokens=reply.output_tokens,
    )


SUMMARIZE = Workflow(
    name="summarize",
    version=1,
    input_model=SummarizeInput,
    steps=(Step("summarize", summarize, timeout_seconds=60.0, max_attempts=3),),
    # A text file (its text must fit SummarizeInput.text, like an inline one) or a JSON
    # input object; 4 bytes a character at most.
    by_reference=ByReference(frozenset({"text/plain", "text/markdown", "application/json"}),
                             max_bytes=800_000),
)
