"""`calmq jobs list|show|events|cancel`, `dlq summary` and `submit`/`status` on the real stack.

The jobs commands read PostgreSQL directly but answer in the API's JSON shapes: each test
compares the CLI's output with the API's answer for the same job.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest

from calmq.tooling.devstack import StackState
from tests.support.api import Api
from tests.support.cli import calmq, insert_jobs, new_tenant, statuses
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

_TERMINAL = ("completed", "dead_letter", "cancelled")
_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def tenant(stack: StackState) -> tuple[str, uuid.UUID, Api]:
    name, tenant_id, key = new_tenant(stack, "clijobs")
    return name, tenant_id, Api(stack.env["CALMQ_API_URL"], key)


def _finished(api: Api, job_id: str) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        lambda: (j := api.job(job_id))["status"] in _TERMINAL and j, timeout=60,
        what=f"job {job_id} to finish")
    return found


def _ok(res: Any) -> Any:
    assert res.returncode == 0, res.stderr
    return res


def test_list_pages_with_the_apis_filters_and_shape(
    stack: StackState, tenant: tuple[str, uuid.UUID, Api]
) -> None:
    """jobs list -o json is the API's JobPage (plus each job's tenant); --cursor pages on."""
    name, _tenant_id, api = tenant
    done = [api.submit({"text": f"list {n}", "mode": "success"}) for n in range(2)]
    for job_id in done:
        _finished(api, job_id)
    status, _h, page = api.call("GET", "/v1/jobs?status=completed&limit=10")
    assert status == 200, page

    res = _ok(calmq(stack, "jobs", "list", "--tenant", name, "--status", "completed",
                    "-o", "json"))
    body = json.loads(res.stdout)
    assert body["next_cursor"] is None
    assert [{k: v for k, v in j.items() if k != "tenant"} for j in body["jobs"]] == page["jobs"]
    assert {j["tenant"] for j in body["jobs"]} == {name}

    first = json.loads(_ok(calmq(stack, "jobs", "list", "--tenant", name, "--status",
                                 "completed", "--limit", "1", "-o", "json")).stdout)
    assert [j["job_id"] for j in first["jobs"]] == [page["jobs"][0]["job_id"]]
    second = json.loads(_ok(calmq(stack, "jobs", "list", "--tenant", name, "--status",
                                  "completed", "--limit", "1", "--cursor",
                                  first["next_cursor"], "-o", "json")).stdout)
    assert [j["job_id"] for j in second["jobs"]] == [page["jobs"][1]["job_id"]]

    lines = _ok(calmq(stack, "jobs", "list", "--tenant", name, "--status", "queued,completed",
                      "-o", "jsonl")).stdout
    rows = [json.loads(line) for line in lines.splitlines()]  # one job per line
    assert set(done) <= {r["job_id"] for r in rows}
    table = _ok(calmq(stack, "jobs", "list", "--tenant", name, "--status", "completed")).stdout
    assert table.splitlines()[0].split() == ["JOB_ID", "TENANT", "WORKFLOW", "STATUS", "STEP",
                                             "ATTEMPT", "CREATED_AT", "UPDATED_AT"]
    bad = calmq(stack, "jobs", "list", "--status", "sleeping")
    assert bad.returncode == 2
    assert "calmq: error [invalid_status]" in bad.stderr


def test_show_tells_the_whole_story_and_events_streams_the_history(
    stack: StackState, tenant: tuple[str, uuid.UUID, Api]
) -> None:
    """jobs show: the API's JobView plus tenant, attempts, errors and trace id; jobs events
    -o jsonl: one history event per line, the SSE stream's data."""
    name, _tenant_id, api = tenant
    job_id = _submit_traced(api)
    view = _finished(api, job_id)
    assert view["status"] == "dead_letter"

    story = json.loads(_ok(calmq(stack, "jobs", "show", job_id, "-o", "json")).stdout)
    assert {k: story[k] for k in view} == view  # the API's shape, key for key
    assert story["tenant"] == name
    assert story["trace_id"] == _TRACE_ID
    assert [(a["round"], a["attempt"], a["outcome"], a["error_class"])
            for a in story["attempts"]] == [(0, 1, "failed", "verifier")]
    assert story["error"]["code"] == "malformed_output"
    assert story["input"]["mode"] == "malformed"
    assert (story["pool"], story["priority"]) == ("default", "bulk")

    table = _ok(calmq(stack, "jobs", "show", job_id)).stdout
    assert f"trace id  {_TRACE_ID}" in table
    assert "\nattempts\n" in table
    assert "\ntimeline\n" in table
    assert [line.split()[1] for line in table.split("\ntimeline\n")[1].splitlines()] == [
        e["type"] for e in view["events"]]

    lines = _ok(calmq(stack, "jobs", "events", job_id, "-o", "jsonl")).stdout.splitlines()
    events = [json.loads(line) for line in lines]
    assert events == [{"job_id": job_id, **e} for e in view["events"]]

    missing = calmq(stack, "jobs", "show", str(uuid.uuid4()))
    assert missing.returncode == 1
    assert missing.stderr.startswith("calmq: error [not_found]: no job ")
    assert calmq(stack, "jobs", "events", "not-a-uuid").returncode == 2


def _submit_traced(api: Api) -> str:
    status, _h, body = api.call(
        "POST", "/v1/jobs", {"workflow": "summarize",
                             "input": {"text": "dies", "mode": "malformed"}},
        headers={"traceparent": f"00-{_TRACE_ID}-00f067aa0ba902b7-01"})
    assert status == 202, body
    return str(body["job_id"])


def test_cancel_named_jobs_and_by_filter(stack: StackState, tmp_path: Any) -> None:
    """Named jobs are cancelled at once; a filter is a bulk action (--yes, summary); a
    terminal job is skipped with its reason, and a re-run finds nothing left."""
    name, tenant_id, _key = new_tenant(stack, "clicancel")
    queued = insert_jobs(stack, tenant_id, 12, status="queued")
    done = insert_jobs(stack, tenant_id, 1, status="completed")

    named = _ok(calmq(stack, "jobs", "cancel", str(queued[0]), str(done[0]), "-o", "json"))
    report = json.loads(named.stdout)
    assert [(o["job_id"], o["outcome"], o["code"]) for o in report["outcomes"]] == [
        (str(queued[0]), "cancelled", None), (str(done[0]), "skipped", "job_terminal")]

    refused = calmq(stack, "jobs", "cancel", "--tenant", name)
    assert refused.returncode == 2
    assert refused.stderr.startswith("11 jobs to cancel: created before ")

    bulk = _ok(calmq(stack, "jobs", "cancel", "--tenant", name, "--yes", "--limit", "4",
                     "--checkpoint", str(tmp_path / "cancel.json")))
    assert bulk.stdout.splitlines()[-1] == "11 cancelled"
    assert set(statuses(stack, queued).values()) == {"cancelled"}
    assert statuses(stack, done) == {done[0]: "completed"}
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        events = conn.execute("SELECT count(*) FROM job_events WHERE job_id = ANY(%s)"
                              " AND type = 'cancelled'", (queued,)).fetchone()
    assert events == (12,)  # each cancelled once: the bulk run skipped the one named before

    again = _ok(calmq(stack, "jobs", "cancel", "--tenant", name, "--yes"))
    assert again.stderr.startswith("0 jobs to cancel")
    assert calmq(stack, "jobs", "cancel").returncode == 1  # no ids and no filter: refused


def test_dlq_summary_groups_by_step_and_failure(stack: StackState) -> None:
    """dlq summary: one row per workflow/step, failure class and code, oldest and newest."""
    name, tenant_id, _key = new_tenant(stack, "clisum")
    insert_jobs(stack, tenant_id, 3, code="malformed_output", failure_class="verifier")
    insert_jobs(stack, tenant_id, 2, code="provider_unavailable", failure_class="transient")
    groups = json.loads(_ok(calmq(stack, "dlq", "summary", "--tenant", name, "-o",
                                  "json")).stdout)
    assert [(g["workflow"], g["step"], g["failure_class"], g["code"], g["count"])
            for g in groups] == [("summarize", "summarize", "verifier", "malformed_output", 3),
                                 ("summarize", "summarize", "transient",
                                  "provider_unavailable", 2)]
    assert all(g["oldest"] <= g["newest"] for g in groups)
    table = _ok(calmq(stack, "dlq", "summary", "--tenant", name)).stdout
    assert table.splitlines()[-1] == "5 dead letter(s) in 2 group(s)"
    listed = json.loads(_ok(calmq(stack, "dlq", "list", "--tenant", name, "--json")).stdout)
    assert len(listed) == 5
    assert set(listed[0]) == {"id", "tenant_id", "tenant", "workflow", "workflow_version",
                              "priority", "pool", "step", "attempt", "error", "created_at",
                              "dead_lettered_at"}  # the shape scripts read, unchanged


def test_submit_defaults_to_the_apis_priority_and_status_reads_it(
    stack: StackState, tenant: tuple[str, uuid.UUID, Api]
) -> None:
    _name, _tenant_id, api = tenant
    res = _ok(calmq(stack, "submit", "--api-key", api.key, "--text", "hi", "--mode", "success"))
    job_id = json.loads(res.stdout)["job_id"]
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        row = conn.execute("SELECT priority FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == ("bulk",)  # the API's default (SubmitRequest.priority)
    shown = _ok(calmq(stack, "status", "--api-key", api.key, job_id))
    assert json.loads(shown.stdout)["job_id"] == job_id
