"""A streamed step through the real stack: the worker streams the model's answer from the
fake provider (OpenAI's chunked event format), its text reaches the Python client's event
stream as ``output.delta`` events while the step runs, a stream that breaks off is told
with ``reset`` and streamed again by the next attempt, ``Last-Event-ID`` resumes mid-text,
and ``Prefer: wait`` answers a fast job in the same request."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import psycopg
import pytest

from calmq.producers.client import Client, RetryPolicy
from calmq.retrying import Backoff
from calmq.tooling.devstack import StackState
from tests.integration.test_client_resilience import Restartable
from tests.support.api import create_tenant
from tests.support.waiting import wait_for
from tests.support.workflow_env import WorkflowEnv
from tests.support.workflows import POOL

pytestmark = pytest.mark.integration


@pytest.fixture
def key(stack: StackState) -> str:
    """A new tenant's API key."""
    return create_tenant(stack.env["CALMQ_DATABASE_URL"], f"stream-{uuid.uuid4().hex[:8]}")


def _client(stack: StackState, key: str) -> Client:
    return Client(stack.env["CALMQ_API_URL"], key)


async def _events(client: Client, job_id: str, after: str = "0") -> list[dict[str, Any]]:
    return [event async for event in client.events(job_id, after=after)]


async def _result(client: Client, job_id: str) -> dict[str, Any]:
    raw = b"".join([chunk async for chunk in client.artifact(job_id)])
    found: dict[str, Any] = json.loads(raw)
    return found


def _history_id(event: dict[str, Any]) -> int:
    return int(str(event["id"]).split(":")[0])


def _stream_id(event: dict[str, Any]) -> int:
    return int(str(event["id"]).split(":")[1])


def _text(events: list[dict[str, Any]]) -> str:
    """The step's text as a client builds it: the deltas since the last reset."""
    text = ""
    for event in events:
        if event["type"] == "reset":
            text = ""
        elif event["type"] == "output.delta":
            text += event["text"]
    return text


async def test_a_streamed_jobs_deltas_reach_the_client_and_make_its_result(
        stack: StackState, key: str) -> None:
    """The deltas arrive before the job's completed event, numbered in order with their
    offsets, and their concatenation is exactly the stored result."""
    async with _client(stack, key) as client:
        accepted = await client.submit("draft", {"prompt": "queues carry slow work",
                                                 "tokens": 40, "tokens_per_second": 100})
        events = await _events(client, accepted["job_id"])
        result = await _result(client, accepted["job_id"])
    types = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "output.delta"]
    # The first piece is written at once and the rest later, so a 40-token answer written
    # over 0.4 s is at least two deltas however the machine is loaded.
    assert len(deltas) >= 2
    assert types.index("output.delta") < types.index("completed")
    seqs = [d["seq"] for d in deltas]
    assert seqs == sorted(set(seqs))
    assert [d["offset"] for d in deltas] == [
        sum(len(d["text"]) for d in deltas[:n]) for n in range(len(deltas))]
    assert "reset" not in types
    assert _text(events) == result["text"]
    assert len(result["text"].split(" ")) == 40


async def test_last_event_id_resumes_the_text_where_the_client_left_it(
        stack: StackState, key: str) -> None:
    """Once the job is final its deltas are compacted into its text; a stream opened again
    after a delta's id gives exactly the rest of that text, and no history event twice."""
    async with _client(stack, key) as client:
        accepted = await client.submit("draft", {"prompt": "every delta counts",
                                                 "tokens": 30, "tokens_per_second": 100})
        events = await _events(client, accepted["job_id"])
        # Once the job is final its chunks are compacted into one text: resume from that.
        compacted = await asyncio.to_thread(wait_for, lambda: _compacted(
            stack, accepted["job_id"]), timeout=60, what="the job's chunks to be compacted")
        first = next(e for e in events if e["type"] == "output.delta")
        rest = await _events(client, accepted["job_id"], after=str(first["id"]))
        result = await _result(client, accepted["job_id"])
    assert compacted == result["text"]
    assert first["text"] + _text(rest) == result["text"]
    # An id is the whole position; its first number is the history event's.
    history = [e for e in events if e["type"] not in ("output.delta", "reset")]
    later = [e for e in history if events.index(e) > events.index(first)]
    assert [_history_id(e) for e in rest if e["type"] not in ("output.delta", "reset")] \
        == [_history_id(e) for e in later]


def _compacted(stack: StackState, job_id: str) -> str | None:
    """The job's compacted text, once no chunk of it is left."""
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        left = conn.execute("SELECT count(*) FROM job_output_chunks WHERE job_id = %s",
                            (job_id,)).fetchone()
        row = conn.execute("SELECT text FROM job_outputs WHERE job_id = %s",
                           (job_id,)).fetchone()
    return str(row[0]) if row is not None and left is not None and left[0] == 0 else None


@pytest.fixture
def api(stack: StackState) -> Iterator[Restartable]:
    server = Restartable(stack)
    try:
        yield server
    finally:
        server.stop()


async def test_the_text_survives_a_kill_of_the_api_mid_stream(
        stack: StackState, key: str, api: Restartable) -> None:
    """The API is SIGKILLed after the first delta and started again: the client resumes
    with Last-Event-ID, and the deltas it got still join, offset by offset, into exactly
    the stored result (none lost, none repeated)."""
    policy = RetryPolicy(attempts=40, max_elapsed=90.0,
                         backoff=Backoff(initial=0.1, maximum=1.0))
    async with Client(api.url, key, retry=policy) as client:
        accepted = await client.submit("draft", {"prompt": "keep every word", "tokens": 200,
                                                 "tokens_per_second": 50})
        events: list[dict[str, Any]] = []
        restart: asyncio.Future[None] | None = None
        async for event in client.events(accepted["job_id"]):
            events.append(event)
            if restart is None and event["type"] == "output.delta":
                restart = asyncio.get_running_loop().run_in_executor(None, api.kill_and_restart)
        assert restart is not None
        await restart
        result = await _result(client, accepted["job_id"])
    deltas = [e for e in events if e["type"] == "output.delta"]
    assert api.restarts == 1
    assert "reset" not in [e["type"] for e in events]
    assert [d["offset"] for d in deltas] == [
        sum(len(d["text"]) for d in deltas[:n]) for n in range(len(deltas))]
    assert _text(events) == result["text"]
    assert events[-1]["type"] == "completed"


@pytest.fixture
def wf(stack: StackState) -> Iterator[WorkflowEnv]:
    """An API and a worker of the test pool, both this test's (the worker is killed)."""
    env = WorkflowEnv(stack)
    try:
        yield env
    finally:
        env.close()


async def test_a_kill_of_the_worker_mid_stream_resets_and_streams_the_new_attempt(
        wf: WorkflowEnv) -> None:
    """The worker is SIGKILLed after the first delta and another started: once the lease
    expires the job runs again, and the client gets ``reset``, then the new attempt's
    whole text from seq 1, which is the stored result."""
    key = wf.api.key
    async with Client(wf.api_url, key) as client:
        accepted = await client.submit("draft_t", {"prompt": "start again from here",
                                                   "tokens": 200, "tokens_per_second": 40})
        events: list[dict[str, Any]] = []
        killed = False
        async for event in client.events(accepted["job_id"]):
            events.append(event)
            if not killed and event["type"] == "output.delta":
                killed = True
                wf.worker.kill()
                await asyncio.to_thread(wf.worker.wait, 10)
                wf.worker, wf.worker_port = await asyncio.to_thread(wf.start_worker, POOL)
        result = await _result(client, accepted["job_id"])
    types = [e["type"] for e in events]
    assert "reset" in types
    reset = types.index("reset")
    before = [e for e in events[:reset] if e["type"] == "output.delta"]
    after = [e for e in events[reset:] if e["type"] == "output.delta"]
    assert before
    assert after[0]["seq"] == 1
    assert after[0]["offset"] == 0
    # An id's second number is the stream: the attempt's fencing token, a new one.
    assert {_stream_id(d) for d in after} == {_stream_id(events[reset])}
    assert _stream_id(events[reset]) > _stream_id(before[0])
    assert _text(events) == result["text"]
    assert types[-1] == "completed"


async def test_a_stream_that_breaks_off_is_reset_and_streamed_again(
        stack: StackState, key: str) -> None:
    """The fake cuts the first attempt's stream half way: the client gets that attempt's
    first deltas, then ``reset``, then the next attempt's whole text, which is the
    result."""
    async with _client(stack, key) as client:
        accepted = await client.submit("draft", {
            "prompt": "try again from the start", "tokens": 20, "tokens_per_second": 200,
            "mode": "stream_break", "fail_times": 1})
        events = await _events(client, accepted["job_id"])
        result = await _result(client, accepted["job_id"])
    types = [e["type"] for e in events]
    assert "reset" in types
    before = [e for e in events[:types.index("reset")] if e["type"] == "output.delta"]
    after = [e for e in events[types.index("reset"):] if e["type"] == "output.delta"]
    assert before
    assert {d["attempt"] for d in before} == {1}
    assert {d["attempt"] for d in after} == {2}
    assert after[0]["seq"] == 1
    assert _text(events) == result["text"]
    assert len(result["text"].split(" ")) == 20


async def _post(stack: StackState, key: str, body: dict[str, Any], idem: str, wait: int = 5
                ) -> tuple[int, dict[str, str], dict[str, Any], float]:
    started = time.monotonic()
    async with aiohttp.ClientSession() as session, session.post(
            stack.env["CALMQ_API_URL"] + "/v1/jobs", json=body,
            headers={"Authorization": f"Bearer {key}", "Idempotency-Key": idem,
                     "Prefer": f"wait={wait}"}) as resp:
        return (resp.status, dict(resp.headers), await resp.json(),
                time.monotonic() - started)


async def test_prefer_wait_answers_a_fast_job_in_the_same_request(stack: StackState,
                                                                  key: str) -> None:
    """Prefer: wait=5: a 1 s job answers 200 with its result and Preference-Applied, a
    10 s job 202 after the 5 s; an idempotent retry of either answers the same way (the
    slow job's retry waits 1 s: one of 5 s, sent 5 s in, may rightly see it complete)."""
    fast = {"workflow": "draft", "input": {"prompt": "a quick answer", "tokens": 5,
                                           "ttft_ms": 1000}}
    slow = {"workflow": "draft", "input": {"prompt": "a slow answer", "tokens": 5,
                                           "ttft_ms": 10_000}}
    fast_key, slow_key = str(uuid.uuid4()), str(uuid.uuid4())
    status, headers, body, _took = await _post(stack, key, fast, fast_key)
    assert status == 200
    assert headers["Preference-Applied"] == "wait=5"
    assert body["status"] == "completed"
    assert body["result"]["text"] == "a quick answer a quick"
    again = await _post(stack, key, fast, fast_key)
    assert again[0] == 200
    assert again[2]["job_id"] == body["job_id"]
    assert again[2]["result"] == body["result"]

    status, headers, body, took = await _post(stack, key, slow, slow_key)
    assert status == 202
    assert "Preference-Applied" not in headers
    assert took >= 5
    again = await _post(stack, key, slow, slow_key, wait=1)
    assert again[0] == 202
    assert again[2]["job_id"] == body["job_id"]


async def test_the_client_submit_waits_for_a_fast_job(stack: StackState, key: str) -> None:
    """``Client.submit(..., wait=5)`` returns the job's final view with its result."""
    async with _client(stack, key) as client:
        answer = await client.submit("draft", {"prompt": "answer me now", "tokens": 3},
                                     wait=5)
    assert answer["status"] == "completed"
    assert answer["result"] == {"text": "answer me now"}
