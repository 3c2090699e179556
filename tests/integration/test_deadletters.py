"""Dead-letter review and redrive on the real stack: CLI, store operation and guards."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from calmq.data import Store
from calmq.deadletters import DeadLetterFilter, DeadLetters, RedriveOutcome
from calmq.tooling.devstack import StackState
from calmq.workflows import Workflow
from calmq.workflows.summarize import SUMMARIZE
from tests.support.api import Api, create_tenant, lifecycle
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

_TERMINAL = ("completed", "dead_letter", "cancelled")


@pytest.fixture(scope="module")
def tenant_name() -> str:
    return f"dlq-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def api(stack: StackState, tenant_name: str) -> Api:
    key = create_tenant(stack.env["CALMQ_DATABASE_URL"], tenant_name)
    return Api(stack.env["CALMQ_API_URL"], key)


def _terminal(api: Api, job_id: str) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        lambda: (j := api.job(job_id))["status"] in _TERMINAL and j,
        timeout=60, what=f"job {job_id} to finish",
    )
    return found


def _dead_letter(api: Api, text: str) -> str:
    job_id = api.submit({"text": text, "mode": "malformed"})
    assert _terminal(api, job_id)["status"] == "dead_letter"
    return job_id


def _calmq(stack: StackState, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    env.update(stack.env)
    return subprocess.run([sys.executable, "-m", "calmq.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def _set_mode(stack: StackState, mode: str | None) -> None:
    req = urllib.request.Request(
        stack.env["CALMQ_FAKE_PROVIDER_URL"] + "/admin/mode", method="POST",
        data=json.dumps({"mode": mode}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


@pytest.fixture
def provider_mode(stack: StackState) -> Iterator[Any]:
    """Flip the shared fake provider's mode; always put it back (it affects every job)."""
    try:
        yield lambda mode: _set_mode(stack, mode)
    finally:
        _set_mode(stack, None)


def _with_dead_letters(stack: StackState, fn: Any) -> Any:
    async def go() -> Any:
        store = Store(stack.env["CALMQ_DATABASE_URL"], max_size=2)
        await store.open()
        try:
            return await fn(DeadLetters(store))
        finally:
            await store.close()

    return asyncio.run(go())


def test_dead_letter_shown_fixed_and_redriven_to_completed(
    stack: StackState, api: Api, tenant_name: str, provider_mode: Any
) -> None:
    """A malformed-output dead letter is listed, shown, redriven after the fix, and completes."""
    job_id = _dead_letter(api, "the model answers garbage for this one")

    listed = _calmq(stack, "dlq", "list", "--tenant", tenant_name, "--code", "malformed_output",
                    "--json")
    assert listed.returncode == 0, listed.stderr
    assert job_id in [row["id"] for row in json.loads(listed.stdout)]

    shown = _calmq(stack, "dlq", "show", job_id)
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["status"] == "dead_letter"
    assert record["input"]["mode"] == "malformed"
    assert record["error"]["code"] == "malformed_output"
    assert [(a["attempt"], a["outcome"], a["error_class"]) for a in record["attempts"]] == [
        (1, "failed", "verifier")]
    assert lifecycle(record["events"]) == ["queued", "running", "dead_lettered"]

    provider_mode("success")  # the fix: the provider now answers the schema
    redriven = _calmq(stack, "dlq", "redrive", job_id, "--reason", "provider fixed",
                      "--by", "oncall@test")
    assert redriven.returncode == 0, redriven.stderr
    assert "1 redriven" in redriven.stdout

    job = _terminal(api, job_id)
    assert job["status"] == "completed"
    assert job["attempt"] == 1  # a fresh budget: attempts count from 1 again
    types = lifecycle(job["events"])
    assert types == ["queued", "running", "dead_lettered", "redriven", "running", "completed"]
    redrive = job["events"][3]["detail"]
    assert redrive["by"] == "oncall@test"
    assert redrive["reason"] == "provider fixed"
    assert redrive["previous_error"]["code"] == "malformed_output"

    # The earlier round's attempt is kept next to the new one.
    after = json.loads(_calmq(stack, "dlq", "show", job_id).stdout)
    assert [(a["round"], a["attempt"], a["outcome"]) for a in after["attempts"]] == [
        (1, 1, "failed"), (0, 1, "completed")]


def test_redrive_never_touches_a_job_that_is_not_dead_lettered(
    stack: StackState, api: Api
) -> None:
    """Redriving a completed job, or the same dead letter twice, writes nothing extra."""
    done = api.submit({"text": "fine", "mode": "success"})
    assert _terminal(api, done)["status"] == "completed"
    dead = _dead_letter(api, "dies once")

    async def twice(dlq: DeadLetters) -> list[RedriveOutcome]:
        first = await dlq.redrive([uuid.UUID(done), uuid.UUID(dead)], by="t", reason="r")
        second = await dlq.redrive([uuid.UUID(dead)], by="t", reason="again")
        return first + second

    outcomes = _with_dead_letters(stack, twice)
    assert [(o.outcome, o.code) for o in outcomes] == [
        ("skipped", "not_dead_lettered"), ("redriven", None), ("skipped", "not_dead_lettered")]
    assert lifecycle(api.job(done)["events"]) == ["queued", "running", "completed"]
    # Still malformed (no fix), so it dies again, with exactly one redrive in between.
    wait_for(lambda: [e["type"] for e in api.job(dead)["events"]].count("dead_lettered") == 2,
             timeout=60, what="the redriven job to die again")
    assert [e["type"] for e in api.job(dead)["events"]].count("redriven") == 1


def test_dry_run_writes_nothing_and_filters_select(stack: StackState, api: Api,
                                                   tenant_name: str) -> None:
    """A dry run reports would_redrive and leaves the job dead; filters narrow the list."""
    dead = _dead_letter(api, "dry run candidate")

    async def go(dlq: DeadLetters) -> tuple[Any, ...]:
        dry = await dlq.redrive([uuid.UUID(dead)], by="t", reason="r", dry_run=True)
        mine = await dlq.find(DeadLetterFilter(tenant=tenant_name, failure_class="verifier"))
        other = await dlq.find(DeadLetterFilter(tenant=tenant_name, failure_class="transient"))
        return dry, mine, other

    dry, mine, other = _with_dead_letters(stack, go)
    assert [o.outcome for o in dry] == ["would_redrive"]
    assert api.job(dead)["status"] == "dead_letter"
    assert lifecycle(api.job(dead)["events"]) == ["queued", "running", "dead_lettered"]
    assert dead in [str(r.id) for r in mine]
    assert dead not in [str(r.id) for r in other]


class _StricterInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(min_length=1)
    language: str  # today's version needs a field the old input never had


def test_redrive_rejects_input_that_no_longer_fits_todays_workflow(
    stack: StackState, api: Api
) -> None:
    """Input is re-validated against today's workflow version; a misfit stays dead."""
    dead = _dead_letter(api, "old shape of input")
    today: dict[str, Workflow] = {
        "summarize": replace(SUMMARIZE, version=SUMMARIZE.version + 1, input_model=_StricterInput)
    }

    async def go() -> list[RedriveOutcome]:
        store = Store(stack.env["CALMQ_DATABASE_URL"], max_size=1)
        await store.open()
        try:
            return await DeadLetters(store, workflows=today).redrive(
                [uuid.UUID(dead)], by="t", reason="r")
        finally:
            await store.close()

    [outcome] = asyncio.run(go())
    assert (outcome.outcome, outcome.code) == ("rejected", "invalid_input")
    assert api.job(dead)["status"] == "dead_letter"


def test_http_lists_and_redrives_only_the_callers_dead_letters(
    stack: StackState, api: Api
) -> None:
    """GET /v1/dead-letters is tenant-scoped; POST .../redrive requeues, 409s, and 404s."""
    dead = _dead_letter(api, "over http")
    other = Api(stack.env["CALMQ_API_URL"],
                create_tenant(stack.env["CALMQ_DATABASE_URL"], f"other-{uuid.uuid4().hex[:8]}"))

    status, _h, body = api.call("GET", "/v1/dead-letters?code=malformed_output&limit=200")
    assert status == 200, body
    assert dead in [d["job_id"] for d in body["dead_letters"]]
    status, _h, body = other.call("GET", "/v1/dead-letters")
    assert (status, body["dead_letters"]) == (200, [])

    path = f"/v1/dead-letters/{dead}/redrive"
    status, _h, body = other.call("POST", path, {"reason": "not mine"})
    assert (status, body["code"]) == (404, "not_found")
    status, _h, body = api.call("POST", path, {"reason": "look first", "dry_run": True})
    assert (status, body["status"], body["redrive"]["outcome"]) == (
        200, "dead_letter", "would_redrive")
    status, _h, body = api.call("POST", path, {"reason": "retry over http", "by": "ops"})
    assert status == 200, body
    assert body["redrive"]["outcome"] == "redriven"
    assert "redriven" in [e["type"] for e in body["events"]]
    status, _h, body = api.call("POST", f"/v1/dead-letters/{_completed(api)}/redrive",
                                {"reason": "it is fine"})
    assert (status, body["code"]) == (409, "not_dead_lettered")


def _completed(api: Api) -> str:
    job_id = api.submit({"text": "fine", "mode": "success"})
    assert _terminal(api, job_id)["status"] == "completed"
    return job_id


def test_rate_spreads_a_redrive_and_a_bare_redrive_is_refused(
    stack: StackState, api: Api
) -> None:
    """--rate 4 over 3 jobs spans about 0.5 s of redrives; no ids and no filter is an error."""
    bare = _calmq(stack, "dlq", "redrive", "--reason", "everything")
    assert bare.returncode == 1
    assert "redrive_needs_target" in bare.stderr

    jobs = [_dead_letter(api, f"paced {n}") for n in range(3)]
    done = _calmq(stack, "dlq", "redrive", *jobs, "--reason", "paced", "--rate", "4")
    assert done.returncode == 0, done.stderr

    def redriven_at(job_id: str) -> datetime:
        return next(datetime.fromisoformat(e["at"]) for e in api.job(job_id)["events"]
                    if e["type"] == "redriven")

    times = sorted(redriven_at(j) for j in jobs)
    # The third starts >= 0.5 s after the pacing clock started; the first job's own
    # database work (well under 0.2 s) is the only slack. Unpaced, all three take ~20 ms.
    assert (times[-1] - times[0]).total_seconds() >= 0.3, times


def test_concurrent_redrives_of_one_job_requeue_it_once(stack: StackState, api: Api) -> None:
    """Two operators redriving the same dead letter at once: one redrives, one is skipped."""
    dead = uuid.UUID(_dead_letter(api, "raced"))

    async def race(dlq: DeadLetters) -> list[RedriveOutcome]:
        pair = await asyncio.gather(dlq.redrive([dead], by="a", reason="r"),
                                    dlq.redrive([dead], by="b", reason="r"))
        return [o for outcomes in pair for o in outcomes]

    outcomes = _with_dead_letters(stack, race)
    assert sorted(o.outcome for o in outcomes) == ["redriven", "skipped"]
    events = [e["type"] for e in api.job(str(dead))["events"]]
    assert events.count("redriven") == 1
