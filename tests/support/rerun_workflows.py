"""The workflow of the rerun tests (tests/integration/test_reruns.py), registered in the API
and the worker they start (``CALMQ_WORKFLOW_MODULES=tests.support.rerun_workflows``), on a
pool of their own so the stack's worker (pool ``default``) never runs it.

``rerun3``: three steps, each a paid call at the fake provider (a summary of the previous
step's summary), so the calls the provider counts for a job say which steps ran.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from calmq.workflows import Step, StepContext, StepOutput, Workflow
from calmq.workflows.summarize import SummarizeInput, summarize

NAME = "rerun3"
POOL = "wfrerun"
STEPS = ("outline", "draft", "polish")


class Summary(BaseModel):
    """What every step records, and what a replacement input of a later step must be."""

    model_config = ConfigDict(extra="forbid")

    summary: str = Field(min_length=1)


async def again(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    """A paid call that summarizes the previous step's summary."""
    return await summarize(ctx, {"text": data["summary"], "mode": "success"})


WORKFLOWS = [
    Workflow(name=NAME, version=1, input_model=SummarizeInput, pool=POOL,
             review_threshold=None,
             steps=(Step(STEPS[0], summarize, output_model=Summary),
                    Step(STEPS[1], again, output_model=Summary),
                    Step(STEPS[2], again, output_model=Summary))),
]
