"""A workflow whose two steps share a stable prompt prefix of about 4,000 tokens (the fake
counts four characters a token), marked for the provider's prompt cache
(calmq.calls.caching), for tests/integration/test_prompt_caching.py
(``CALMQ_WORKFLOW_MODULES=tests.support.cache_workflows``), on a pool of their own. Each step
may call ``FIRST`` then ``SECOND`` (calmq.calls.fallback): the test's fake answers 429 for
``FIRST`` for a while, and the calls move on. A job submitted with ``mode: low_confidence``
waits for a review after its last step (its approval completes it, in the API)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from calmq.calls.caching import stable
from calmq.calls.output_schemas import read_answer
from calmq.workflows import Step, StepContext, StepOutput, Workflow
from calmq.workflows.summarize import SummaryOutput, _output_schema

CACHE_POOL = "cache"
FIRST, SECOND = "cache-first", "cache-second"
# The stable prefix: the same on every call of both steps, every job and every retry.
PREFIX = ("You answer with a JSON summary of the user's text, using the handbook below. "
          + "".join(f"Handbook rule {n:04d}: a lease is renewed before it expires. "
                    for n in range(280)))[:16_000]
PREFIX_TOKENS = len(PREFIX) // 4


class HandbookInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(min_length=1, max_length=10_000)
    mode: str | None = None
    fail_times: int | None = Field(default=None, ge=0, le=10)


def _step(name: str, *, last: bool = False) -> Step:
    async def run(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
        reply = await ctx.provider.complete(
            messages=[stable({"role": "system", "content": PREFIX}),
                      {"role": "user", "content": json.dumps(data)}],
            job_id=ctx.job_id, max_tokens=128, response_schema=_output_schema())
        answer = read_answer(SummaryOutput, reply.content or "")
        # The next step's input: the answer (a fresh call, the same prefix), and a review
        # asked for on to the last step, whose confidence alone decides it.
        review = {"mode": "low_confidence"} if data.get("mode") == "low_confidence" else {}
        return StepOutput(artifact={"text": answer.summary, **review},
                          confidence=answer.confidence if last else None,
                          input_tokens=reply.input_tokens, output_tokens=reply.output_tokens)

    return Step(name, run, timeout_seconds=30.0, max_attempts=4, models=(FIRST, SECOND))


HANDBOOK = Workflow(name="handbook_cached", version=1, input_model=HandbookInput,
                    steps=(_step("read"), _step("answer", last=True)),
                    pool=CACHE_POOL)


def workflows() -> list[Workflow]:
    return [HANDBOOK]
