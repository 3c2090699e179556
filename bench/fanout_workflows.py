"""The fan-out run's workflow (``calmq bench fanout``): ``bench_fanout``, whose ``split`` step
starts ``n`` summarize children (docs/how-to/fan-out.md) and whose ``gather`` step counts
what it got. Loaded by the bench's API and worker with
``CALMQ_WORKFLOW_MODULES=bench.fanout_workflows``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from calmq.settings import Settings
from calmq.workflows import Step, StepContext, StepOutput, Workflow

WORKFLOW = "bench_fanout"
TEXT = "Kafka and PostgreSQL carry slow AI jobs."


class FanoutInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(ge=1, le=1_000_000)


async def split(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    n = FanoutInput.model_validate(data).n
    return ctx.spawn("summarize", [{"text": TEXT, "mode": "success"}] * n,
                     output={"n": n})


async def gather(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    done = sum(1 for c in data["children"] if c["status"] == "completed")
    return StepOutput(artifact={"n": data["n"], "completed": done})


def workflows(settings: Settings) -> list[Workflow]:
    return [Workflow(name=WORKFLOW, version=1, input_model=FanoutInput, review_threshold=None,
                     steps=(Step("split", split, timeout_seconds=600.0),
                            Step("gather", gather, timeout_seconds=600.0)))]
