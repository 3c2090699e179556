"""Bad input to POST /v1/jobs: a 4xx problem+json with a stable code, and no row written."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tenant(stack: StackState) -> tuple[Api, str]:
    name = f"bad-{uuid.uuid4().hex[:8]}"
    return Api(
        stack.env["CALMQ_API_URL"], create_tenant(stack.env["CALMQ_DATABASE_URL"], name)
    ), name


def _jobs_of(stack: StackState, name: str) -> int:
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM jobs j JOIN tenants t ON t.id = j.tenant_id"
            "        WHERE t.name = %s)"
            " + (SELECT count(*) FROM outbox o JOIN jobs j ON j.id::text = o.aggregateid"
            "    JOIN tenants t ON t.id = j.tenant_id WHERE t.name = %s)",
            (name, name),
        ).fetchone()
    assert row is not None
    return int(row[0])


CASES = [
    pytest.param({"raw": b"{not json"}, 400, "invalid_json", id="invalid-json"),
    pytest.param(
        {
            "raw": b'{"workflow": "summarize", "input": {"text": "x"}}',
            "headers": {"Content-Type": "text/plain"},
        },
        415,
        "unsupported_media_type",
        id="wrong-content-type",
    ),
    pytest.param({"body": {"input": {"text": "x"}}}, 422, "invalid_body", id="missing-workflow"),
    pytest.param(
        {"body": {"workflow": "nope", "input": {"text": "x"}}},
        422,
        "unknown_workflow",
        id="unknown-workflow",
    ),
    pytest.param(
        {"body": {"workflow": "summarize", "input": {"text": 5}}},
        422,
        "invalid_input",
        id="input-wrong-type",
    ),
    pytest.param(
        {"body": {"workflow": "summarize", "input": {"text": "x"}, "priority": 3}},
        422,
        "invalid_body",
        id="priority-wrong-type",
    ),
    pytest.param(
        {"body": {"workflow": "summarize", "input": {"text": "x"}, "deadline_seconds": "soon"}},
        422,
        "invalid_body",
        id="deadline-wrong-type",
    ),
    pytest.param(
        {"body": {"workflow": "summarize", "input": {"text": "x"}, "colour": "red"}},
        422,
        "invalid_body",
        id="unknown-field",
    ),
    pytest.param({"body": {"workflow": "summarize"}}, 422, "invalid_body", id="no-input"),
    pytest.param(
        {
            "raw": json.dumps(
                {"workflow": "summarize", "input": {"text": "x" * (1024 * 1024 + 10)}}
            ).encode()
        },
        413,
        "body_too_large",
        id="body-over-1MiB",
    ),
    pytest.param({"body": ["a", "list"]}, 422, "invalid_body", id="not-an-object"),
]


@pytest.mark.parametrize(("request_", "status", "code"), CASES)
def test_bad_submit_is_problem_and_writes_nothing(
    tenant: tuple[Api, str], stack: StackState, request_: dict, status: int, code: str
) -> None:
    """Each kind of bad submit answers its 4xx problem+json code and writes no row."""
    api, name = tenant
    before = _jobs_of(stack, name)
    got_status, headers, body = api.call(
        "POST",
        "/v1/jobs",
        request_.get("body"),
        raw=request_.get("raw"),
        headers=request_.get("headers"),
    )
    assert got_status == status, body
    assert headers["Content-Type"].startswith("application/problem+json")
    assert body["code"] == code
    assert {"type", "title", "status", "detail", "code"} <= set(body)
    assert _jobs_of(stack, name) == before


@pytest.mark.parametrize("auth", [None, "Bearer ", "Bearer cq_not-a-real-key", "Basic abc"])
def test_missing_or_wrong_key_is_401(
    tenant: tuple[Api, str], stack: StackState, auth: str | None
) -> None:
    """No key, an empty key, an unknown key or another scheme answer 401 and write nothing."""
    api, name = tenant
    before = _jobs_of(stack, name)
    headers = {"Authorization": auth} if auth is not None else {"Authorization": ""}
    status, hdrs, body = api.call(
        "POST", "/v1/jobs", {"workflow": "summarize", "input": {"text": "x"}}, headers=headers
    )
    assert status == 401
    assert hdrs["Content-Type"].startswith("application/problem+json")
    assert body["code"] in ("missing_api_key", "invalid_api_key")
    assert _jobs_of(stack, name) == before


_SUMMARIZE = b'{"workflow": "summarize", "input": {"text": "x"}'

# Bad input that used to reach PostgreSQL (or the parser's recursion limit) as a 5xx.
HOSTILE = [
    pytest.param({"raw": _SUMMARIZE + b', "metadata": {"deep": ' + b"[" * 100_000
                  + b"]" * 100_000 + b"}}"}, 400, "invalid_json", id="nested-too-deep"),
    pytest.param({"raw": _SUMMARIZE + b', "metadata": {"n": NaN}}'}, 400, "invalid_json",
                 id="nan-in-metadata"),
    pytest.param({"raw": _SUMMARIZE + b', "metadata": {"n": -Infinity}}'}, 400,
                 "invalid_json", id="infinity-in-metadata"),
    pytest.param({"raw": _SUMMARIZE + b', "metadata": {"n": 1e999}}'}, 400,
                 "non_finite_number", id="1e999-in-metadata"),
    pytest.param({"raw": _SUMMARIZE + b', "metadata": {"deep": [{"n": -1E400}]}}'}, 400,
                 "non_finite_number", id="minus-1e400-deep-in-metadata"),
    pytest.param({"raw": _SUMMARIZE + b', "metadata": {"n": 1e999}}',
                  "headers": {"Idempotency-Key": "non-finite"}}, 400, "non_finite_number",
                 id="1e999-in-metadata-with-a-key"),
    pytest.param({"body": {"workflow": "summarize", "input": {"text": "a\u0000b"}}}, 400,
                 "unstorable_text", id="nul-in-input"),
    pytest.param({"body": {"workflow": "summarize", "input": {"text": "x"},
                           "metadata": {"k\u0000": "v"}}}, 400, "unstorable_text",
                 id="nul-in-metadata-key"),
    pytest.param({"raw": b'{"workflow": "summarize", "input": {"text": "lone \\ud800"}}'},
                 400, "unstorable_text", id="lone-surrogate-in-input"),
    pytest.param({"body": {"workflow": "summarize", "input": {"text": "x"}},
                  "headers": {"Idempotency-Key": "k\xe9y"}}, 400, "invalid_header",
                 id="non-ascii-idempotency-key"),
]


@pytest.mark.parametrize(("request_", "status", "code"), HOSTILE)
def test_hostile_submit_is_a_4xx_problem_and_writes_nothing(
    tenant: tuple[Api, str], stack: StackState, request_: dict, status: int, code: str
) -> None:
    """Deep nesting, NaN, 1e999, NUL, lone surrogates and non-ASCII headers answer 400, not
    5xx."""
    api, name = tenant
    before = _jobs_of(stack, name)
    got_status, headers, body = api.call(
        "POST", "/v1/jobs", request_.get("body"), raw=request_.get("raw"),
        headers=request_.get("headers"))
    assert (got_status, body["code"]) == (status, code), body
    assert headers["Content-Type"].startswith("application/problem+json")
    assert "PostgreSQL" not in body["detail"]
    assert "jsonb" not in body["detail"]
    assert _jobs_of(stack, name) == before


@pytest.mark.parametrize("traceparent", [
    "00-\xff-01",  # not UTF-8: aiohttp hands it over as a lone surrogate
    "00-zz",
    "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",  # uppercase
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" + "x" * 1000,
])
def test_a_traceparent_not_in_the_w3c_format_is_ignored_not_stored(
    tenant: tuple[Api, str], stack: StackState, traceparent: str
) -> None:
    """A traceparent that is not W3C-formatted starts a new trace (W3C Trace Context): the
    submit is accepted and the job stores none, so none reaches its events or the provider."""
    api, _name = tenant
    status, _headers, body = api.call(
        "POST", "/v1/jobs", {"workflow": "summarize", "input": {"text": "x"}},
        headers={"traceparent": traceparent})
    assert status == 202, body
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        row = conn.execute("SELECT trace_parent FROM jobs WHERE id = %s",
                           (body["job_id"],)).fetchone()
    assert row == (None,)


def test_nul_in_a_query_parameter_is_400(tenant: tuple[Api, str]) -> None:
    """A NUL in a list filter answers 400 invalid_query instead of a database error."""
    api, _name = tenant
    status, _headers, body = api.call("GET", "/v1/jobs?workflow=sum%00marize")
    assert (status, body["code"]) == (400, "invalid_query"), body


def _settled(api: Api, job_id: str, status: str) -> dict:
    return wait_for(lambda: (j := api.job(job_id))["status"] == status and j, timeout=60,
                    what=f"job {job_id} to be {status}")


def test_nul_in_review_and_redrive_text_is_400(tenant: tuple[Api, str]) -> None:
    """A NUL in a review's reason or a redrive's by answers 400 and leaves the job as it was."""
    api, _name = tenant
    review = api.submit({"text": "unsure", "mode": "low_confidence"})
    _settled(api, review, "awaiting_review")
    status, _h, body = api.call("POST", f"/v1/jobs/{review}/review",
                                {"decision": "reject", "reviewer": "me", "reason": "no\u0000pe"})
    assert (status, body["code"]) == (400, "unstorable_text"), body
    assert api.job(review)["status"] == "awaiting_review"

    dead = api.submit({"text": "garbage out", "mode": "malformed"})
    _settled(api, dead, "dead_letter")
    status, _h, body = api.call("POST", f"/v1/dead-letters/{dead}/redrive",
                                {"reason": "again", "by": "ops\u0000"})
    assert (status, body["code"]) == (400, "unstorable_text"), body
    assert api.job(dead)["status"] == "dead_letter"


def test_1e999_in_review_corrections_is_400_and_leaves_the_job_waiting(
        tenant: tuple[Api, str]) -> None:
    """A review whose corrected fields hold 1e999 answers 400 non_finite_number and the job
    still waits for review (no event, no artifact written)."""
    api, _name = tenant
    review = api.submit({"text": "unsure", "mode": "low_confidence"})
    _settled(api, review, "awaiting_review")
    before = api.job(review)["events"]
    status, _h, body = api.call(
        "POST", f"/v1/jobs/{review}/review",
        raw=b'{"decision": "approve", "reviewer": "me", '
            b'"fields": {"summary": "fine", "extra": {"score": 1e999}}}')
    assert (status, body["code"]) == (400, "non_finite_number"), body
    job = api.job(review)
    assert job["status"] == "awaiting_review"
    assert job["events"] == before
    assert job["artifact"] is None
