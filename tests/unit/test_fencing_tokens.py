"""The fencing token travels with every write of an attempt (issue 15): its outcome, its
step output and the keys of the objects it writes all carry the claim's lease_version."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from calmq.data import Job
from calmq.errors import FailureClass, StepFailure
from calmq.objects import FileObjectStore
from calmq.processors.failures import FailureStage
from calmq.retrying import Backoff
from calmq.workflows import Step, StepContext, StepOutput, Workflow
from calmq.workflows.progress import Progress, artifact_key


class _In(BaseModel):
    text: str


async def _noop(_ctx: StepContext, _data: dict[str, Any]) -> StepOutput:
    return StepOutput({})


TWO = Workflow(name="two", version=1, input_model=_In,
               steps=(Step("first", _noop), Step("second", _noop)))


def _job(lease_version: int, step: str = "second") -> Job:
    return Job(id=uuid.uuid4(), tenant_id=uuid.uuid4(), workflow="two", workflow_version=1,
               priority="bulk", pool="default", step=step, attempt=1, max_attempts=3,
               input={"text": "x"}, input_ref=None, metadata={}, deadline_at=None,
               trace_parent=None, created_at=datetime.now(UTC), old_status="queued",
               lease_version=lease_version)


def test_attempts_of_one_step_write_their_artifacts_to_different_keys() -> None:
    tenant, job = uuid.uuid4(), uuid.uuid4()
    keys = {artifact_key(tenant, job, "summarize", v) for v in (1, 2, 3)}
    assert len(keys) == 3
    assert all(k.startswith(f"{tenant}/artifacts/{job}.summarize.") for k in keys)
    # The artifact a review completes has a key no attempt uses.
    assert artifact_key(tenant, job, "summarize") not in keys


def test_a_steps_own_objects_are_kept_per_attempt() -> None:
    ctx = StepContext("job", "tenant", "chunk", 2, provider=None,  # type: ignore[arg-type]
                      lease_version=7)
    assert ctx.object_key("chunks.json") == "tenant/job/chunk/7/chunks.json"
    assert ctx.object_key("chunks.json") != StepContext(
        "job", "tenant", "chunk", 2, provider=None,  # type: ignore[arg-type]
        lease_version=8).object_key("chunks.json")


def test_a_success_carries_the_token_into_its_outcome_record_and_artifact(
        tmp_path: Path) -> None:
    job = _job(lease_version=5)
    progress = Progress(None, FileObjectStore(tmp_path), 60.0)  # type: ignore[arg-type]
    finish = asyncio.run(progress.succeeded(job, TWO, StepOutput({"summary": "s"}), "w"))
    assert finish.lease_version == 5
    assert finish.row(0)["lease_version"] == 5
    assert finish.record_params()["lease_version"] == 5
    assert finish.artifact is not None
    assert finish.artifact["uri"].endswith(f"{job.id}.second.5.json")


def test_a_failure_carries_the_token_into_its_outcome() -> None:
    stage = FailureStage(worker_id="w", tiers=[("5s", 5.0)], backoff=Backoff(1, 5, 2),
                         workflows={"two": TWO})
    finish = stage.outcome(_job(lease_version=9), "t", StepFailure(
        "away", code="upstream_unavailable", failure_class=FailureClass.TRANSIENT))
    assert finish.lease_version == 9
    assert finish.row(0)["lease_version"] == 9
