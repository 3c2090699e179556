"""The claim stage's deferral against the real PostgreSQL: a message whose job is claimable
but was not taken is never acknowledged, however many claims that takes; a message whose
job is out of sight is given up on after a time, not after a number of claims.

Driven step by step (the stage's own code, a real Store, a settable clock) so that "more
claims than the old bound" and "past the time bound" need no waiting.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from calmq.data import Store
from calmq.processors.claim import Claim
from calmq.processors.request import Request
from calmq.tooling.devstack import StackState
from tests.support.cli import new_tenant

pytestmark = pytest.mark.integration

# The old bound was ten deferrals (~4 s); twice as many claims, 100 s of the clock apart.
CLAIMS = 20
STEP_SECONDS = 5.0


def _queued_job(url: str, tenant_id: uuid.UUID) -> uuid.UUID:
    """A summarize job queued on a pool nobody consumes (no outbox row: only the test
    claims it)."""
    job_id = uuid.uuid4()
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,"
            " pool, step, attempt, max_attempts, input)"
            " VALUES (%s, %s, 'summarize', 1, 'queued', 'bulk', 'deferral-nobody',"
            " 'summarize', 0, 3, %s)", (job_id, tenant_id, Jsonb({"text": "wait for me"})))
    return job_id


def _request(job_id: uuid.UUID, tenant_id: uuid.UUID) -> Request:
    return Request(position=(("calmq.deferral-nobody.bulk", 0), 7), job_id=job_id,
                   step="summarize", workflow="summarize", tenant=str(tenant_id),
                   priority="bulk", message=object())


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _scenario(url: str, body: Any) -> Any:
    store = Store(url, min_size=1, max_size=2)
    await store.open()
    clock = _Clock()
    acked: list[Any] = []
    claim = Claim(store, worker_id="deferral-test", lease_seconds=60.0,
                  workflows={}, acknowledge=acked.append,
                  resubmit=lambda _m: None, clock=clock)
    try:
        return await body(claim, clock, acked)
    finally:
        await store.close()


def test_a_claimable_job_the_claim_did_not_take_is_never_acknowledged(
        stack: StackState) -> None:
    """A queued job this process still runs an attempt of (a reaper took its lease) is not
    taken by the claim; its message is deferred for as long as that lasts, past the old
    bound of ten claims and past any time bound, and claimed once the attempt has ended."""
    url = stack.env["CALMQ_DATABASE_URL"]
    _name, tenant_id, _key = new_tenant(stack, "deferral")
    job_id = _queued_job(url, tenant_id)
    request = _request(job_id, tenant_id)

    async def body(claim: Claim, clock: _Clock, acked: list[Any]) -> list[uuid.UUID]:
        for _ in range(CLAIMS):
            got = await claim.claim([request], lambda _id: True)  # still running here
            assert got.jobs == []
            assert acked == [], "a claimable job's message was acknowledged"
            clock.now += STEP_SECONDS
        got = await claim.claim([request], lambda _id: False)  # the old attempt ended
        return [job.id for _r, job in got.jobs]

    assert asyncio.run(_scenario(url, body)) == [job_id]


def test_a_message_without_a_job_row_is_acknowledged_after_a_time_not_a_count(
        stack: StackState) -> None:
    """A message whose job has no row is claimed again for OUT_OF_SIGHT_SECONDS however
    many claims fit in it, then acknowledged once."""
    _name, tenant_id, _key = new_tenant(stack, "deferral-gone")
    request = _request(uuid.uuid4(), tenant_id)  # never inserted: a row deleted meanwhile

    async def body(claim: Claim, clock: _Clock, acked: list[Any]) -> int:
        start = clock.now
        step = Claim.OUT_OF_SIGHT_SECONDS / (CLAIMS + 1)
        for _ in range(CLAIMS):
            await claim.claim([request], lambda _id: False)
            assert acked == [], "acknowledged before its time bound"
            clock.now += step
        clock.now = start + Claim.OUT_OF_SIGHT_SECONDS
        await claim.claim([request], lambda _id: False)
        return len(acked)

    assert asyncio.run(_scenario(stack.env["CALMQ_DATABASE_URL"], body)) == 1
