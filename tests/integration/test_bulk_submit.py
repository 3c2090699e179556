"""Bulk submit on the real stack (issue 43): POST /v1/jobs/bulk answers each item on its own
and writes the accepted ones in one transaction; GET /v1/jobs and `calmq jobs list` filter
by a metadata value; `calmq submit --file` resumes after an interrupt without submitting
anything twice."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from calmq.tooling.devstack import StackState
from tests.support.api import Api
from tests.support.cli import calmq, calmq_env, new_tenant

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tenant(stack: StackState) -> tuple[str, uuid.UUID, Api]:
    name, tenant_id, key = new_tenant(stack, "bulk")
    return name, tenant_id, Api(stack.env["CALMQ_API_URL"], key)


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def _job(tag: str, n: int, **extra: Any) -> dict[str, Any]:
    return {"workflow": "summarize", "input": {"text": f"item {n}", "mode": "success"},
            "metadata": {"backfill": tag, "n": str(n)}, **extra}


def _tagged(stack: StackState, tag: str) -> list[tuple[Any, ...]]:
    """(job id, the transaction that wrote its ``queued`` event) of the jobs carrying
    ``tag``. The event row is never updated, so its xmin stays its writer's (a job row's
    changes as soon as a worker claims it)."""
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        return conn.execute(
            "SELECT j.id, (SELECT e.xmin::text FROM job_events e "
            "  WHERE e.job_id = j.id AND e.type = 'queued' ORDER BY e.id LIMIT 1) "
            "FROM jobs j WHERE j.metadata @> %s::jsonb",
            (json.dumps({"backfill": tag}),)).fetchall()


def test_bulk_answers_each_item_in_order_and_a_bad_item_refuses_only_itself(
        stack: StackState, tenant: tuple[str, uuid.UUID, Api]) -> None:
    """Good, invalid, unknown-workflow, non-object and repeated-key items in one request
    each get their own result in input order; only the good ones are written."""
    _name, _id, api = tenant
    tag = _tag()
    items: list[Any] = [
        _job(tag, 0),
        {"workflow": "summarize", "input": {"nope": 1}, "metadata": {"backfill": tag}},
        _job(tag, 2, idempotency_key=f"{tag}-k"),
        {"workflow": "no-such-workflow", "input": {"text": "x"}, "metadata": {"backfill": tag}},
        "not an object",
        _job(tag, 2, idempotency_key=f"{tag}-k"),  # the same item under the same key
        _job(tag, 6, unknown_field=True),
        _job(tag, 7),
    ]
    status, _h, body = api.call("POST", "/v1/jobs/bulk", {"jobs": items})
    assert status == 200, body
    results = body["results"]
    assert [r["index"] for r in results] == list(range(len(items)))
    assert [r["status"] for r in results] == [
        "accepted", "refused", "accepted", "refused", "refused", "duplicate", "refused",
        "accepted"]
    assert results[5]["job_id"] == results[2]["job_id"]
    codes = {i: r["problem"]["code"] for i, r in enumerate(results) if r["status"] == "refused"}
    assert codes[1] == "invalid_input", codes
    assert codes[3] == "unknown_workflow", codes
    assert (codes[4], codes[6]) == ("invalid_body", "invalid_body"), codes
    assert all(r["problem"]["status"] in (400, 404, 422) for r in results
               if r["status"] == "refused")
    assert (body["accepted"], body["duplicate"], body["refused"]) == (3, 1, 4)
    # A refused item's problem is the one POST /v1/jobs answers for the same body.
    single_status, _h, single = api.call("POST", "/v1/jobs", items[1])
    assert (single_status, single) == (results[1]["problem"]["status"], results[1]["problem"])
    written = {str(row[0]) for row in _tagged(stack, tag)}
    assert written == {r["job_id"] for r in results if r["status"] == "accepted"}
    assert api.job(results[0]["job_id"])["metadata"] == {"backfill": tag, "n": "0"}


def test_bulk_writes_its_jobs_in_one_transaction(
        stack: StackState, tenant: tuple[str, uuid.UUID, Api]) -> None:
    """Every job a bulk request accepts was written by one PostgreSQL transaction (their
    queued events share one xmin), and a refused item left no row at all."""
    _name, _id, api = tenant
    tag = _tag()
    items = [_job(tag, n) for n in range(300)]
    items[150] = {**items[150], "deadline_seconds": -1}  # refused: not a row of the others'
    status, _h, body = api.call("POST", "/v1/jobs/bulk", {"jobs": items})
    assert status == 200, body
    assert (body["accepted"], body["refused"]) == (299, 1), body
    rows = _tagged(stack, tag)
    assert len(rows) == 299
    assert {row[1] for row in rows} == {rows[0][1]}, "more than one transaction wrote them"


def test_a_key_sent_again_answers_duplicate_and_with_another_body_refused_409(
        tenant: tuple[str, uuid.UUID, Api]) -> None:
    """A bulk item whose key was used before answers duplicate with the earlier job when the
    item is the same, and refused with idempotency_key_reused (409) when it differs; a key
    from a single POST /v1/jobs is not confused with another tenant's or another body."""
    _name, _id, api = tenant
    tag = _tag()
    first = [_job(tag, 0, idempotency_key=f"{tag}-a"), _job(tag, 1, idempotency_key=f"{tag}-b")]
    status, _h, body = api.call("POST", "/v1/jobs/bulk", {"jobs": first})
    assert (status, body["accepted"]) == (200, 2), body
    again = [dict(reversed(list(first[0].items()))),  # the same item, keys in another order
             _job(tag, 99, idempotency_key=f"{tag}-b")]
    status, _h, repeat = api.call("POST", "/v1/jobs/bulk", {"jobs": again})
    assert status == 200, repeat
    assert repeat["results"][0]["status"] == "duplicate"
    assert repeat["results"][0]["job_id"] == body["results"][0]["job_id"]
    assert repeat["results"][1]["status"] == "refused"
    assert repeat["results"][1]["problem"]["code"] == "idempotency_key_reused"
    assert repeat["results"][1]["problem"]["status"] == 409


def test_more_jobs_than_the_setting_allows_is_refused_whole(
        stack: StackState, tenant: tuple[str, uuid.UUID, Api]) -> None:
    """1,001 items (api_bulk_max_jobs is 1,000) answer 413 too_many_jobs and write nothing;
    an empty list or a body without jobs is 422 invalid_body."""
    _name, _id, api = tenant
    tag = _tag()
    status, _h, body = api.call("POST", "/v1/jobs/bulk",
                                {"jobs": [_job(tag, n) for n in range(1001)]})
    assert (status, body["code"]) == (413, "too_many_jobs"), body
    assert "api_bulk_max_jobs" in body["detail"]
    assert _tagged(stack, tag) == []
    for bad in ({"jobs": []}, {"items": [_job(tag, 0)]}, {"jobs": [_job(tag, 0)], "x": 1}):
        status, _h, body = api.call("POST", "/v1/jobs/bulk", bad)
        assert (status, body["code"]) == (422, "invalid_body"), (bad, body)
    assert _tagged(stack, tag) == []


def test_jobs_list_filters_by_a_metadata_value_page_by_page(
        stack: StackState, tenant: tuple[str, uuid.UUID, Api]) -> None:
    """GET /v1/jobs?metadata.backfill=TAG lists exactly the tagged jobs across cursor pages,
    two metadata filters must both hold, and `calmq jobs list --metadata` does the same."""
    name, _id, api = tenant
    tag = _tag()
    status, _h, body = api.call("POST", "/v1/jobs/bulk",
                                {"jobs": [_job(tag, n) for n in range(7)]})
    assert (status, body["accepted"]) == (200, 7), body
    api.submit({"text": "untagged", "mode": "success"}, metadata={"backfill": "other"})
    seen: list[str] = []
    cursor = None
    while True:
        path = f"/v1/jobs?metadata.backfill={tag}&limit=3" + (f"&cursor={cursor}" if cursor
                                                              else "")
        status, _h, page = api.call("GET", path)
        assert status == 200, page
        seen += [j["job_id"] for j in page["jobs"]]
        assert all(j["metadata"]["backfill"] == tag for j in page["jobs"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(r["job_id"] for r in body["results"])
    status, _h, page = api.call("GET", f"/v1/jobs?metadata.backfill={tag}&metadata.n=4")
    assert status == 200, page
    assert [j["metadata"]["n"] for j in page["jobs"]] == ["4"], page
    status, _h, page = api.call("GET", "/v1/jobs?metadata.=x")
    assert (status, page["code"]) == (400, "invalid_query"), page
    res = calmq(stack, "jobs", "list", "--tenant", name, "--metadata", f"backfill={tag}",
                "--limit", "100", "-o", "json")
    assert res.returncode == 0, res.stderr
    assert sorted(j["job_id"] for j in json.loads(res.stdout)["jobs"]) == sorted(seen)


def test_submit_file_stopped_midway_and_resumed_submits_each_line_once(
        stack: StackState, tenant: tuple[str, uuid.UUID, Api], tmp_path: Path) -> None:
    """`calmq submit --file` stopped after 2 chunks (--max-chunks) and run again finishes
    the file; with its checkpoint removed a third run answers every line duplicate; bad
    lines are reported with their numbers; each good line is exactly one job."""
    _name, _id, api = tenant
    tag = _tag()
    lines = [json.dumps(_job(tag, n)) for n in range(25)]
    lines[3] = "{not json"
    lines[17] = "[1, 2]"
    source = tmp_path / "jobs.jsonl"
    source.write_text("\n".join(lines) + "\n")
    env = calmq_env(stack, CALMQ_API_KEY=api.key)
    first = calmq(stack, "submit", "--file", str(source), "--chunk-size", "5",
                  "--max-chunks", "2", "-o", "json", env=env)
    assert first.returncode == 130, first.stderr
    summary = json.loads(first.stdout)
    assert (summary["complete"], summary["accepted"]) == (False, 10), summary
    assert len(_tagged(stack, tag)) == 10

    second = calmq(stack, "submit", "--file", str(source), "--chunk-size", "5", "-o", "json",
                   env=env)
    assert second.returncode == 3, second.stderr  # bad lines: a partial success
    summary = json.loads(second.stdout)
    assert (summary["complete"], summary["resumed_at_line"]) == (True, 12), summary
    assert (summary["accepted"], summary["duplicate"], summary["bad_lines"]) == (23, 0, 2)
    assert sorted(p["line"] for p in summary["problems"]) == [4, 18]
    assert len(_tagged(stack, tag)) == 23

    # The checkpoint lost (or lagging): the lines' keys still say they were sent.
    (tmp_path / "jobs.jsonl.calmq-checkpoint.json").unlink()
    third = calmq(stack, "submit", "--file", str(source), "--chunk-size", "7", "-o", "json",
                  env=env)
    summary = json.loads(third.stdout)
    assert (summary["accepted"], summary["duplicate"]) == (0, 23), summary
    assert len(_tagged(stack, tag)) == 23
