"""The built-in ``draft`` workflow: one streamed model step, artifact ``{"text": str}``.

The interactive example: a person waits for a reply, a summary or a letter and reads it as
the model writes it. The step's call is streamed (``Step(stream=True)``), so a client
following the job (``GET /v1/jobs/{id}/events``) receives its text as ``output.delta``
events; the artifact's ``text`` is exactly their concatenation.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from calmq.errors import FailureClass, StepFailure
from calmq.workflows import Step, StepContext, StepOutput, Workflow

__all__ = ["DRAFT", "DraftInput", "DraftOutput", "draft"]


class DraftInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=100_000)
    max_tokens: int = Field(default=1024, ge=1, le=16_384)
    # Knobs of the fake provider, passed through to it (see docs/reference/fake-provider.md):
    # its mode, the answer's length in tokens and its pace.
    mode: str | None = Field(default=None, max_length=40)
    fail_times: int | None = Field(default=None, ge=0, le=100)
    delay_ms: int | None = Field(default=None, ge=0, le=600_000)
    tokens: int | None = Field(default=None, ge=1, le=16_384)
    ttft_ms: int | None = Field(default=None, ge=0, le=600_000)
    tokens_per_second: float | None = Field(default=None, gt=0, le=100_000)


class DraftOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)


_SYSTEM = ("Write a plain-text draft that answers the user's request. Answer with the text "
           "alone: no preamble, no markup.")


async def draft(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    reply = await ctx.provider.complete(
        messages=[{"role": "system", "content": _SYSTEM},
                  {"role": "user", "content": json.dumps(data)}],
        job_id=ctx.job_id,
        max_tokens=int(data.get("max_tokens", 1024)),
    )
    if reply.refusal:
        raise StepFailure(f"the model refused: {reply.refusal[:200]}", code="model_refusal",
                          failure_class=FailureClass.POLICY)
    if not reply.content:
        raise StepFailure("the model answered no text", code="malformed_output",
                          failure_class=FailureClass.VERIFIER)
    return StepOutput(artifact={"text": reply.content}, input_tokens=reply.input_tokens,
                      output_tokens=reply.output_tokens)


DRAFT = Workflow(
    name="draft",
    version=1,
    input_model=DraftInput,
    steps=(Step("draft", draft, timeout_seconds=120.0, max_attempts=3, stream=True,
                output_model=DraftOutput),),
    # Prose has no confidence to review.
    review_threshold=None,
)
