"""The workflow of the self-fencing test (tests/integration/test_fencing.py), registered in
the workers it starts (``CALMQ_WORKFLOW_MODULES=tests.support.fencing_workflows``).

Its first attempt holds (as a slow model call would) until its worker stops it, and notes in
the folder named by its input when it started and when it was stopped; every later attempt
summarizes through the fake provider at once. The folder's notes are how the test sees, from
outside the worker, that the attempt stopped and when.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from calmq.workflows import Step, StepContext, StepOutput, Workflow
from calmq.workflows.summarize import summarize

NAME = "fence_hold"  # the workflow's one step has the same name (tests.support.workers.submit)


class HoldInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str
    mode: str | None = None
    notes: str  # a folder the attempts note their start and stop in


async def hold_first(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    notes = Path(data["notes"])
    if ctx.attempt == 1:
        (notes / "started").write_text(repr(time.time()))
        try:
            await asyncio.sleep(3600)  # held until the worker stops the attempt
        except asyncio.CancelledError:
            (notes / "stopped").write_text(repr(time.time()))
            raise
    return await summarize(ctx, {"text": data["text"], "mode": data.get("mode") or "success"})


WORKFLOWS = [Workflow(name=NAME, version=1, input_model=HoldInput,
                      steps=(Step(NAME, hold_first, timeout_seconds=3600.0),))]
