"""Reading and managing jobs: listing with filters and cursors, artifact, cancel, delete."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote, urlparse

import pytest

from calmq.producers.client import ApiError, Client
from calmq.tooling.devstack import StackState
from tests.e2e.test_api_intake import MP_HEADERS, multipart
from tests.support.api import Api, create_tenant
from tests.support.intake import db
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

TERMINAL = ("completed", "dead_letter", "cancelled")


def _api(stack: StackState) -> Api:
    return Api(stack.env["CALMQ_API_URL"],
               create_tenant(stack.env["CALMQ_DATABASE_URL"], f"jobs-{uuid.uuid4().hex[:8]}"))


def _terminal(api: Api, job_id: str) -> dict:
    return wait_for(lambda: (j := api.job(job_id))["status"] in TERMINAL and j, timeout=60,
                    what=f"job {job_id} to finish")


def test_list_filters_and_cursor_pagination(stack: StackState) -> None:
    """GET /v1/jobs pages newest first through every job once, and filters by status and time."""
    api = _api(stack)
    ids = [api.submit({"text": f"n{i}", "mode": "success"}) for i in range(7)]
    cancelled = api.submit({"text": "to cancel", "mode": "slow"})
    assert api.call("POST", f"/v1/jobs/{cancelled}/cancel")[0] == 200
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        query = "?limit=3" + (f"&cursor={cursor}" if cursor else "")
        status, _h, body = api.call("GET", "/v1/jobs" + query)
        assert status == 200, body
        assert len(body["jobs"]) <= 3
        seen += [j["job_id"] for j in body["jobs"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert sorted(seen) == sorted([*ids, cancelled])
    assert len(set(seen)) == len(seen)
    created = [api.job(j)["created_at"] for j in seen]
    assert created == sorted(created, reverse=True)

    body = api.call("GET", "/v1/jobs?status=cancelled")[2]
    assert [j["job_id"] for j in body["jobs"]] == [cancelled]
    future = quote((datetime.now(UTC) + timedelta(hours=1)).isoformat())
    assert api.call("GET", f"/v1/jobs?created_after={future}")[2]["jobs"] == []
    assert len(api.call("GET", f"/v1/jobs?created_before={future}&workflow=summarize"
                        "&limit=200")[2]["jobs"]) == 8
    assert api.call("GET", "/v1/jobs?workflow=other")[2]["jobs"] == []


def test_metadata_is_returned_by_get_and_the_list(stack: StackState) -> None:
    """A submit's metadata comes back as given from GET /v1/jobs/{id} and GET /v1/jobs."""
    api = _api(stack)
    metadata = {"order_id": "A-17", "source": "crm", "attempt_of": 2}
    job_id = api.submit({"text": "tagged", "mode": "success"}, metadata=metadata)
    plain = api.submit({"text": "untagged", "mode": "success"})
    assert api.job(job_id)["metadata"] == metadata
    assert _terminal(api, job_id)["metadata"] == metadata
    assert api.job(plain)["metadata"] == {}
    listed = {j["job_id"]: j for j in api.call("GET", "/v1/jobs")[2]["jobs"]}
    assert listed[job_id]["metadata"] == metadata
    assert listed[plain]["metadata"] == {}


@pytest.mark.parametrize("query", ["status=finished", "limit=0", "limit=201", "limit=x",
                                   "cursor=@@@", "created_after=yesterday",
                                   "created_after=2026-01-01T00:00:00", "colour=red"])
def test_bad_list_query_is_400_problem(stack: StackState, query: str) -> None:
    """Each bad list query answers 400 problem+json with code invalid_query or invalid_cursor."""
    status, hdrs, body = _api(stack).call("GET", f"/v1/jobs?{query}")
    assert status == 400, body
    assert hdrs["Content-Type"].startswith("application/problem+json")
    assert body["code"] in ("invalid_query", "invalid_cursor")


def test_artifact_streams_the_stored_bytes(stack: StackState) -> None:
    """GET /v1/jobs/{id}/artifact streams the artifact's bytes; a job without one answers 404."""
    api = _api(stack)
    none = api.submit({"text": "no artifact", "mode": "slow"})
    api.call("POST", f"/v1/jobs/{none}/cancel")
    status, _h, body = api.call("GET", f"/v1/jobs/{none}/artifact")
    assert (status, body["code"]) == (404, "artifact_not_found")
    job_id = api.submit({"text": "an artifact please", "mode": "success"})
    job = _terminal(api, job_id)
    assert job["status"] == "completed"
    status, headers, body = api.call("GET", f"/v1/jobs/{job_id}/artifact")
    assert status == 200
    assert headers["Content-Type"].startswith("application/json")
    stored = Path(urlparse(job["artifact"]["uri"]).path).read_bytes()
    assert int(headers["Content-Length"]) == len(stored) == job["artifact"]["size"]
    assert body == __import__("json").loads(stored)


def test_cancel_of_terminal_job_is_409(stack: StackState) -> None:
    """Cancelling a job twice: the first answers 200 cancelled, the second 409 job_terminal."""
    api = _api(stack)
    job_id = api.submit({"text": "cancel me", "mode": "slow"})
    status, _h, body = api.call("POST", f"/v1/jobs/{job_id}/cancel")
    assert (status, body["status"]) == (200, "cancelled")
    status, hdrs, body = api.call("POST", f"/v1/jobs/{job_id}/cancel")
    assert status == 409
    assert hdrs["Content-Type"].startswith("application/problem+json")
    assert body["code"] == "job_terminal"


def test_delete_purges_objects_and_redacts(stack: StackState) -> None:
    """DELETE removes the input and artifact objects, blanks the record and keeps its shape."""
    api = _api(stack)
    status, _h, body = api.call("POST", "/v1/jobs", raw=multipart(
        {"workflow": "summarize", "metadata": '{"secret": "s3cr3t"}'}, b"some input"),
        headers=MP_HEADERS)
    assert status == 202, body
    job_id = body["job_id"]
    job = _terminal(api, job_id)
    with db(stack) as conn:
        (input_ref,) = conn.execute("SELECT input_ref FROM jobs WHERE id = %s",
                                    (job_id,)).fetchone()
    paths = [Path(urlparse(input_ref).path)]
    if job["artifact"]:
        paths.append(Path(urlparse(job["artifact"]["uri"]).path))
    assert all(p.exists() for p in paths)
    status, _h, _b = api.call("DELETE", f"/v1/jobs/{job_id}")
    assert status == 204
    assert not any(p.exists() for p in paths)
    after = api.job(job_id)
    assert after["artifact"] is None
    assert after["status"] == job["status"]
    assert [e["type"] for e in after["events"]] == [e["type"] for e in job["events"]]
    assert all(e["detail"] == {} for e in after["events"])
    with db(stack) as conn:
        row = conn.execute("SELECT input, input_ref, metadata, redacted_at FROM jobs "
                           "WHERE id = %s", (job_id,)).fetchone()
    assert row[:3] == (None, None, {})
    assert row[3] is not None
    assert api.call("DELETE", f"/v1/jobs/{job_id}")[0] == 204  # idempotent


def test_delete_of_unfinished_job_is_409(stack: StackState) -> None:
    """DELETE of a job that is not terminal answers 409 job_not_terminal and changes nothing."""
    api = _api(stack)
    job_id = api.submit({"text": "still going", "mode": "slow"})
    status, _h, body = api.call("DELETE", f"/v1/jobs/{job_id}")
    assert (status, body["code"]) == (409, "job_not_terminal")
    assert api.call("POST", f"/v1/jobs/{job_id}/cancel")[0] == 200


def test_async_client_round_trip(stack: StackState, tmp_path: Path) -> None:
    """producers.client.Client uploads a file, lists, downloads, deletes, and raises ApiError."""
    api = _api(stack)
    source = tmp_path / "doc.txt"
    source.write_bytes(b"streamed from disk " * 100)

    async def run() -> None:
        async with Client(api.base_url, api.key) as client:
            accepted = await client.submit_file("summarize", source, content_type="text/plain",
                                                metadata={"from": "client"})
            job_id = accepted["job_id"]
            listed = await client.list_jobs(limit=5)
            assert [j["job_id"] for j in listed["jobs"]] == [job_id]
            events = [e["type"] async for e in client.events(job_id)]
            assert events[0] == "queued"
            assert events[-1] == "completed"
            job = await client.job(job_id)
            data = b"".join([c async for c in client.artifact(job_id)])
            assert len(data) == job["artifact"]["size"]
            await client.delete(job_id)
            with pytest.raises(ApiError) as gone:
                await client.cancel(job_id)
            assert (gone.value.code, gone.value.status) == ("job_terminal", 409)
            with pytest.raises(ApiError) as missing:
                await client.job(str(uuid.uuid4()))
            assert (missing.value.code, missing.value.status) == ("not_found", 404)

    asyncio.run(asyncio.wait_for(run(), timeout=90))
