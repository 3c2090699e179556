"""The workflows of the child-job tests (tests/integration/test_children.py), registered in
the API and the worker they start (``CALMQ_WORKFLOW_MODULES=tests.support.fanout_workflows``),
on a pool of their own so the stack's worker (pool ``default``) never runs them.

``fanout``: its ``split`` step starts one ``fanout_child`` (a one-step summary, a paid call
at the fake provider whose ``mode`` the test chooses per child) per text, joined by the
input's policy; its ``gather`` step records what it received: each child's status and
summary (read from the child's artifact), in input order. A child has one attempt.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from calmq.workflows import JoinPolicy, RetryPolicy, Step, StepContext, StepOutput, Workflow
from calmq.workflows.summarize import SUMMARIZE

NAME = "fanout"
CHILD = "fanout_child"
RETRIED = "fanout_child_retried"  # the same with summarize's 3 attempts (the chaos test)
TWICE = "fanout_twice"
POOL = "wffanout"


class FanoutInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    texts: list[str] = Field(min_length=1)
    modes: list[str] = Field(default_factory=list)  # per child; default success
    join: Literal["all", "at_least", "all_finish"] = "all"
    k: int | None = None
    # per child: its answer waits this long (a child still running); default none
    delays: list[int] = Field(default_factory=list)
    child: Literal["fanout_child", "fanout_child_retried"] = CHILD


async def split(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    args = FanoutInput.model_validate(data)
    modes = args.modes or ["success"] * len(args.texts)
    delays = args.delays or [0] * len(args.texts)
    # flaky: the child's first call fails (503), every later one succeeds
    return ctx.spawn(args.child, [{"text": t, "mode": m, **({"delay_ms": d} if d else {}),
                              **({"fail_times": 1} if m == "flaky" else {})}
                             for t, m, d in zip(args.texts, modes, delays, strict=True)],
                     join=JoinPolicy(args.join, args.k), output={"asked": len(args.texts)})


async def gather(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    assert ctx.objects is not None
    seen: list[dict[str, Any]] = []
    for child in data["children"]:
        summary = None
        if child["artifact"] is not None:
            summary = json.loads(await ctx.objects.get(child["artifact"]["uri"]))["summary"]
        seen.append({"index": child["index"], "job_id": child["job_id"],
                     "status": child["status"], "summary": summary})
    return StepOutput(artifact={"asked": data["asked"], "children": seen})


async def split_again(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    """A second spawn of the same job: three more children, after the first two joined."""
    return ctx.spawn(CHILD, [{"text": f"again {i}", "mode": "success"} for i in range(3)],
                     output={"first": [c["index"] for c in data["children"]]})


async def gather_again(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    return StepOutput(artifact={"first": data["first"],
                                "second": [c["index"] for c in data["children"]]})


WORKFLOWS = [
    Workflow(name=NAME, version=1, input_model=FanoutInput, pool=POOL, review_threshold=None,
             steps=(Step("split", split), Step("gather", gather))),
    # two spawns in one job: each step that joins gets its own spawn's children
    Workflow(name=TWICE, version=1, input_model=FanoutInput, pool=POOL, review_threshold=None,
             steps=(Step("split", split), Step("again", split_again),
                    Step("gather", gather_again))),
    # One attempt: a transient failure dead-letters the child at once (no forwarder needed),
    # and a redrive's call is the next one the fake provider counts for it.
    replace(SUMMARIZE, name=CHILD, pool=POOL, review_threshold=None,
            steps=(replace(SUMMARIZE.steps[0], retry=RetryPolicy(max_attempts=1)),)),
    replace(SUMMARIZE, name=RETRIED, pool=POOL, review_threshold=None),
]
