"""The API killed with -9 in the middle of a burst of submits loses nothing it accepted."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import aiohttp
import psycopg
import pytest

from calmq.tooling.devstack import StackState, processes
from tests.support.api import create_tenant
from tests.support.intake import start_api
from tests.support.waiting import wait_for

pytestmark = pytest.mark.chaos

BURST = 2000
KILL_AFTER = 500  # accepted submits before the kill: mid-burst, with requests in flight


async def _burst(url: str, key: str, pid: int) -> tuple[list[str], int]:
    accepted: list[str] = []
    unanswered = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(BURST):
        queue.put_nowait(i)
    headers = {"Authorization": f"Bearer {key}"}

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal unanswered
        while not queue.empty():
            i = queue.get_nowait()
            body = {"workflow": "summarize", "input": {"text": f"burst {i}", "mode": "success"}}
            try:
                async with session.post(url + "/v1/jobs", json=body, headers=headers) as resp:
                    data = await resp.json()
                    if resp.status == 202:
                        accepted.append(data["job_id"])
                        if len(accepted) == KILL_AFTER:
                            os.kill(pid, signal.SIGKILL)
                    else:
                        unanswered += 1
            except (TimeoutError, aiohttp.ClientError):
                unanswered += 1

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(64)))
    return accepted, unanswered


def test_api_killed_mid_burst_keeps_every_accepted_job(stack: StackState) -> None:
    """After kill -9 mid-burst: every 202'd job exists and finishes; no job is half-written."""
    name = f"crash-{uuid.uuid4().hex[:8]}"
    key = create_tenant(stack.env["CALMQ_DATABASE_URL"], name)
    api = start_api(stack)
    try:
        accepted, unanswered = asyncio.run(_burst(api.url, key, api.pid))
    finally:
        processes.stop(api.pid, sig=signal.SIGKILL, timeout=5)
    assert len(accepted) >= KILL_AFTER
    assert unanswered > 0  # the kill really happened mid-burst
    assert len(set(accepted)) == len(accepted)

    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        rows = conn.execute(
            "SELECT j.id::text, (SELECT count(*) FROM job_events e WHERE e.job_id = j.id"
            "                    AND e.type = 'queued') FROM jobs j"
            " JOIN tenants t ON t.id = j.tenant_id WHERE t.name = %s", (name,)).fetchall()
    written = {r[0]: r[1] for r in rows}
    missing = set(accepted) - set(written)
    assert missing == set(), f"{len(missing)} accepted jobs are not in the database"
    # Every row written, answered or not, is whole: its first history event is there.
    assert all(n == 1 for n in written.values())

    def all_terminal() -> bool:
        with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE status IN ('completed','dead_letter','cancelled')),"
                " count(*) FROM jobs j JOIN tenants t ON t.id = j.tenant_id WHERE t.name = %s",
                (name,)).fetchone()
        assert row is not None
        return row[0] == row[1]

    # Whole = also relayed: every written job (202'd or not) reaches a terminal state, which
    # it can only do if its outbox row was there and reached Kafka.
    try:
        wait_for(all_terminal, timeout=240, what="every written job to reach a terminal state")
    except AssertionError:
        with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
            counts = conn.execute(
                "SELECT status, count(*) FROM jobs j JOIN tenants t ON t.id = j.tenant_id"
                " WHERE t.name = %s GROUP BY status", (name,)).fetchall()
            unsent = conn.execute(
                "SELECT count(*) FROM outbox o JOIN jobs j ON o.aggregateid = j.id::text"
                " JOIN tenants t ON t.id = j.tenant_id WHERE t.name = %s AND j.status = 'queued'",
                (name,)).fetchone()
        raise AssertionError(f"jobs by status: {counts}; outbox rows of queued jobs still in "
                             f"the table: {unsent}") from None
