"""The upstream client through a bad minute: the API killed and restarted mid-burst.

A real API process (its own, on a fixed port) is killed with SIGKILL while a burst of
submits and an event stream are in flight, and started again on the same port. A submit
with an idempotency key is retried with backoff under that key, and the stream resumes with
Last-Event-ID: every submit ends as exactly one job, and the stream misses no event.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import psycopg
import pytest

from calmq.producers.client import Client, RetryPolicy
from calmq.retrying import Backoff
from calmq.tooling.devstack import StackState, processes
from tests.support.api import create_tenant
from tests.support.intake import ApiProcess, start_api
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

_POLICY = RetryPolicy(attempts=40, max_elapsed=90.0, backoff=Backoff(initial=0.1, maximum=1.0))


class Restartable:
    """An API process that a test kills with SIGKILL and starts again on the same port."""

    def __init__(self, stack: StackState) -> None:
        self.stack = stack
        self.port = processes.free_port()
        self.api: ApiProcess = start_api(stack, port=self.port)
        self.restarts = 0
        # A restart runs in another thread: stop() waits for it, so a failing test never
        # leaves the restarted process behind.
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill_and_restart(self) -> None:
        with self._lock:
            if self._stopped:  # the test ended first: nothing to restart
                return
            self.api.kill()
            self.api = start_api(self.stack, port=self.port)
            self.restarts += 1

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            processes.stop(self.api.pid)


@pytest.fixture
def api(stack: StackState) -> Any:
    server = Restartable(stack)
    try:
        yield server
    finally:
        server.stop()


def _jobs_of(stack: StackState, tenant: str) -> list[str]:
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        rows = conn.execute("SELECT j.id FROM jobs j JOIN tenants t ON t.id = j.tenant_id "
                            "WHERE t.name = %s", (tenant,)).fetchall()
    return [str(r[0]) for r in rows]


async def test_every_submit_of_a_burst_is_one_job_across_an_api_restart(
    stack: StackState, api: Restartable
) -> None:
    """300 submits with idempotency keys, 16 at a time; the API is SIGKILLed after the
    first 100 answers and restarted. Every submit returns a job id, and the tenant has
    exactly those jobs."""
    tenant = f"burst-{uuid.uuid4().hex[:8]}"
    key = await asyncio.to_thread(create_tenant, stack.env["CALMQ_DATABASE_URL"], tenant)
    answered: list[str] = []
    killed = threading.Event()
    gate = asyncio.Semaphore(16)

    async def one(client: Client, n: int) -> str:
        async with gate:
            # The key makes a submit whose answer the kill lost safe to send again.
            body = await client.submit("summarize", {"text": f"burst {n}", "mode": "success"},
                                       idempotency_key=f"{tenant}-{n}")
        answered.append(str(body["job_id"]))
        if len(answered) == 100 and not killed.is_set():
            killed.set()
            # In a thread: the restart takes seconds, and the other submits keep trying.
            threading.Thread(target=api.kill_and_restart, daemon=True).start()
        return str(body["job_id"])

    async with Client(api.url, key, retry=_POLICY) as client:
        ids = await asyncio.gather(*(one(client, n) for n in range(300)))
    wait_for(lambda: api.restarts == 1, timeout=60, what="the API restart to finish")
    assert len(ids) == 300
    assert len(set(ids)) == 300  # no two submits answered with one job
    assert sorted(_jobs_of(stack, tenant)) == sorted(ids)  # and no job without its submit


async def test_event_stream_resumes_after_an_api_restart_without_missing_an_event(
    stack: StackState, api: Restartable
) -> None:
    """A flaky job (fails once, retried after the 5 s tier) is followed over SSE; the API is
    SIGKILLed after the first event. The stream resumes and yields each history event once,
    in order, ending with completed."""
    key = await asyncio.to_thread(create_tenant, stack.env["CALMQ_DATABASE_URL"],
                                  f"sse-{uuid.uuid4().hex[:8]}")
    async with Client(api.url, key, retry=_POLICY) as client:
        job = await client.submit("summarize", {"text": "stream me", "mode": "flaky"})
        job_id = str(job["job_id"])
        seen: list[dict[str, Any]] = []
        restart: asyncio.Future[None] | None = None
        async for event in client.events(job_id):
            seen.append(event)
            if restart is None:
                restart = asyncio.get_running_loop().run_in_executor(None, api.kill_and_restart)
        assert restart is not None
        await restart
        history = (await client.job(job_id))["events"]
    assert api.restarts == 1
    assert [e["type"] for e in seen] == [e["type"] for e in history]
    assert [int(e["id"]) for e in seen] == sorted({int(e["id"]) for e in seen})  # once each
    assert seen[-1]["type"] == "completed"
    assert "retry_scheduled" in [e["type"] for e in seen]  # the stream spanned the retry
