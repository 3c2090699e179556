"""The workflow of the self-fencing test (tests/integration/test_fencing.py), registered in
the workers it starts (``CALMQ_WORKFLOW_MODULES=tests.support.fencing_workflows``).

``fence_hold``: its first attempt holds (as a slow model call would) until its worker stops
it, and notes in the folder named by its input when it started and when it was stopped;
every later attempt summarizes through the fake provider at once. ``fence_effect``: waits
for the test's go-ahead, then makes an external call through the side-effect log, noting
the call. The folder's notes are how the test sees from outside the worker what the
attempt did, and when.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from calmq.workflows import Step, StepContext, StepOutput, Workflow
from calmq.workflows.effects import once
from calmq.workflows.summarize import summarize

# Each workflow's one step has its name (tests.support.workers.submit).
NAME = "fence_hold"
EFFECT = "fence_effect"


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


async def effect_when_told(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    notes = Path(data["notes"])
    (notes / "started").write_text(repr(time.time()))
    while not (notes / "go").exists():  # noqa: ASYNC110 - a file another process writes
        await asyncio.sleep(0.02)  # polling for the test's go-ahead

    async def call(key: str) -> dict[str, Any]:
        (notes / "called").write_text(key)
        return {"posted": key}

    posting = await once(ctx, "ledger", call)
    return StepOutput({"summary": f"posted {posting['posted']}"})


WORKFLOWS = [
    Workflow(name=NAME, version=1, input_model=HoldInput,
             steps=(Step(NAME, hold_first, timeout_seconds=3600.0),)),
    Workflow(name=EFFECT, version=1, input_model=HoldInput,
             steps=(Step(EFFECT, effect_when_told, timeout_seconds=3600.0),)),
]
