"""Notifications and a streamed step's text (issue 42): LISTEN sessions keep TCP keepalives;
the text is announced (NOTIFY calmq_job_output) only while an event stream follows the job,
and never kept once the job is deleted, even when a worker still streaming writes it after
the delete."""

from __future__ import annotations

import json
import os
import socket
import uuid
from typing import Any

import psycopg
import pytest

from calmq.data import Store
from calmq.data.database import listen_connection
from calmq.data.outputs import CHANNEL, OutputChunk
from calmq.data.retention import Retention
from calmq.tooling.devstack import StackState

pytestmark = pytest.mark.integration


def _job(url: str, status: str) -> tuple[uuid.UUID, uuid.UUID]:
    """(tenant, job): a job of a new tenant in ``status``."""
    job, tenant = uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)", (tenant, f"t-{tenant.hex}"))
        conn.execute(
            "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool,"
            " step, attempt, max_attempts, input, metadata)"
            " VALUES (%s, %s, 'summarize', 1, %s, 'interactive', 'default', 'summarize', 1, 3,"
            " '{\"text\": \"x\"}', '{}')", (job, tenant, status))
    return tenant, job


def _chunk(job: uuid.UUID, seq: int, text: str) -> OutputChunk:
    return OutputChunk(job, 1, seq, "summarize", 1, 0, text)


def _announced(conn: psycopg.Connection[Any], until: uuid.UUID) -> set[str]:
    """The job ids of the output notifications, up to the first that names ``until``."""
    seen: set[str] = set()
    for note in conn.notifies(timeout=30.0):
        seen |= {record[0] for record in json.loads(note.payload)}
        if str(until) in seen:
            return seen
    raise AssertionError(f"no notification named {until} within 30 s; saw {seen}")


@pytest.fixture
async def store(stack: StackState) -> Any:
    store = Store(stack.env["CALMQ_DATABASE_URL"], min_size=1, max_size=4)
    await store.open()
    yield store
    await store.close()


async def test_text_of_a_job_nobody_follows_is_written_but_not_announced(
        stack: StackState, store: Store) -> None:
    """With a LISTEN connection open: the chunks of a job no stream follows are stored and
    never announced; those of a followed job are, and stop once its follower leaves."""
    url = stack.env["CALMQ_DATABASE_URL"]
    _, alone = _job(url, "running")
    _, watched = _job(url, "running")
    follower = uuid.uuid4()
    await store.outputs.follow(watched, follower)
    with psycopg.connect(url, autocommit=True) as listen:
        listen.execute(f"LISTEN {CHANNEL}")
        await store.outputs.append([_chunk(alone, 1, "nobody reads this")])
        await store.outputs.append([_chunk(watched, 1, "someone reads this")])
        assert str(alone) not in _announced(listen, until=watched)
        await store.outputs.unfollow(watched, follower)
        await store.outputs.append([_chunk(watched, 2, " and no longer")])
        _, marker = _job(url, "running")
        await store.outputs.follow(marker, uuid.uuid4())
        await store.outputs.append([_chunk(marker, 1, "the end")])
        assert str(watched) not in _announced(listen, until=marker)
    assert [c.text for c in (await store.outputs.after(alone, 0, 0)).chunks] == [
        "nobody reads this"]
    assert len((await store.outputs.after(watched, 0, 0)).chunks) == 2


async def test_text_written_after_a_cancel_and_a_delete_does_not_survive(
        stack: StackState, store: Store) -> None:
    """A job cancelled and deleted (DELETE /v1/jobs/{id}'s redaction) while its worker still
    streams: the chunks that worker writes afterwards are not stored, and the compaction
    pass leaves no text of the job either."""
    url = stack.env["CALMQ_DATABASE_URL"]
    tenant, job = _job(url, "running")
    await store.outputs.append([_chunk(job, 1, "before the cancel")])
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE jobs SET status = 'cancelled' WHERE id = %s", (job,))
    assert await Retention(store).redact(tenant, job)
    await store.outputs.append([_chunk(job, 2, "after the delete")])
    await store.outputs.compact()
    read = await store.outputs.after(job, 0, 0)
    assert (read.chunks, read.compacted) == ([], [])
    with psycopg.connect(url, autocommit=True) as conn:
        left = conn.execute("SELECT (SELECT count(*) FROM job_output_chunks WHERE job_id = %s)"
                            " + (SELECT count(*) FROM job_outputs WHERE job_id = %s)",
                            (job, job)).fetchone()
    assert left == (0,)


async def test_listen_sessions_have_tcp_keepalives(stack: StackState) -> None:
    """The connection the API's hub and the workers' provider listener LISTEN on probes an
    idle peer: SO_KEEPALIVE on, first probe after 30 s, every 10 s, three tries."""
    conn = await listen_connection(stack.env["CALMQ_DATABASE_URL"])
    try:
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
        try:
            assert sock.family in (socket.AF_INET, socket.AF_INET6)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 10
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        finally:
            sock.close()
    finally:
        await conn.close()
