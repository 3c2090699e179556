"""Fencing (issue 15): an attempt that lost its lease can write nothing, and a worker whose
heartbeats fail stops its attempts before their leases run out.

The stale-attempt tests drive the worker's own code (the Store, ``Progress`` that writes
the artifact and builds the outcome, the failure stage, the side-effect log) against the
real PostgreSQL and a real file object store, step by step, so that the stale attempt and
the one that took the job over interleave exactly as the test says: a lease taken over
(the old lease expired and a new claim took the job, in one transaction so that no reaper
of the stack gets between the two), by another worker and by the same worker id (a
restarted pod keeps its name). The self-fencing test cuts a real worker's database
connections with a TCP fault proxy while its attempt is in its step.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from pydantic import BaseModel

from calmq.data import Database, Job, Store
from calmq.data.steps import SideEffects
from calmq.errors import FailureClass, LeaseLost, StepFailure
from calmq.objects import FileObjectStore
from calmq.processors.failures import FailureStage
from calmq.producers.retention import purge
from calmq.retrying import Backoff
from calmq.settings import Settings
from calmq.tooling.devstack import StackState
from calmq.workflows import Step, StepContext, StepOutput, Workflow
from calmq.workflows.progress import Progress
from tests.support import fencing_workflows
from tests.support.cli import new_tenant
from tests.support.faultproxy import FaultProxy
from tests.support.waiting import wait_for
from tests.support.workers import BASE, Env, forwarded_env, history, metric, submit

pytestmark = pytest.mark.integration

WORKFLOW = "fence_two"  # two steps: the last one's output is recorded with the job


class _Input(BaseModel):
    text: str


async def _unused(_ctx: StepContext, _data: dict[str, Any]) -> StepOutput:
    raise AssertionError("the test records outputs itself; no step runs")


TWO_STEPS = Workflow(name=WORKFLOW, version=1, input_model=_Input,
                     steps=(Step("first", _unused), Step("second", _unused)))


def _queued_job(url: str, tenant_id: uuid.UUID) -> uuid.UUID:
    """A job waiting at its last step, on a pool nobody consumes (no outbox row: only the
    test claims it)."""
    job_id = uuid.uuid4()
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,"
            " pool, step, attempt, max_attempts, input)"
            " VALUES (%s, %s, %s, 1, 'queued', 'bulk', 'fencing-nobody', 'second', 0, 5, %s)",
            (job_id, tenant_id, WORKFLOW, Jsonb({"text": "fence me"})))
        conn.execute("INSERT INTO job_events (job_id, type, attempt, detail)"
                     " VALUES (%s, 'queued', 0, '{}')", (job_id,))
    return job_id


def _take_over(url: str, job_id: uuid.UUID, worker: str) -> Job:
    """The holder's lease runs out and ``worker`` claims the job: one transaction."""
    q = Database(url).q
    with psycopg.connect(url, row_factory=dict_row) as conn, conn.transaction():
        conn.execute("UPDATE jobs SET lease_expires_at = now() - interval '1 second'"
                     " WHERE id = %s", (job_id,))
        rows = conn.execute(q["claim_jobs"], {"ids": [job_id], "worker": worker,
                                              "lease_seconds": 120.0, "steps": None}).fetchall()
    assert len(rows) == 1, "the take-over claim did not get the job"
    return Job.from_row(rows[0])


def _row(url: str, job_id: uuid.UUID) -> dict[str, Any]:
    with psycopg.connect(url, row_factory=dict_row) as conn:
        row = conn.execute("SELECT status, attempt, lease_owner, lease_version, artifact"
                           " FROM jobs WHERE id = %s", (job_id,)).fetchone()
        assert row is not None
        row["outputs"] = conn.execute("SELECT step, output FROM step_outputs WHERE job_id = %s",
                                      (job_id,)).fetchall()
        row["results"] = conn.execute(
            "SELECT payload FROM outbox WHERE aggregateid = %s AND type = 'job.result'",
            (str(job_id),)).fetchall()
        row["attempts"] = conn.execute(
            "SELECT attempt, worker, outcome, lease_version FROM job_attempts"
            " WHERE job_id = %s ORDER BY attempt", (job_id,)).fetchall()
        row["effects"] = conn.execute("SELECT key, state, calls FROM side_effects"
                                      " WHERE job_id = %s", (job_id,)).fetchall()
    return row


def _read(uri: str) -> dict[str, Any]:
    return dict(json.loads(Path(unquote(urlparse(uri).path)).read_bytes()))


class _Attempts:
    """The worker's pieces an attempt writes through, on one real Store and object store."""

    def __init__(self, store: Store, root: Path) -> None:
        self.store = store
        self.objects = FileObjectStore(root)
        self.progress = Progress(store, self.objects, 3600.0)

    def failures(self, worker: str) -> FailureStage:
        return FailureStage(worker_id=worker, tiers=[("5s", 5.0)], backoff=Backoff(1, 5, 2),
                            workflows={WORKFLOW: TWO_STEPS})

    async def succeed(self, job: Job, worker: str, summary: str) -> set[uuid.UUID]:
        """What the runner does when the step returned: artifact, outcome, group commit."""
        finish = await self.progress.succeeded(job, TWO_STEPS, StepOutput({"summary": summary}),
                                               worker)
        return await self.store.attempts.finish([finish])


async def _with_attempts(url: str, root: Path, body: Any) -> Any:
    store = Store(url, min_size=1, max_size=2)
    await store.open()
    try:
        return await body(_Attempts(store, root))
    finally:
        await store.close()


def test_a_stale_attempt_writes_nothing_over_the_attempt_that_took_its_job(
        stack: StackState, tmp_path: Path) -> None:
    """Attempt 1 (worker a) loses its lease to attempt 2 (worker b). From then on attempt 1's
    heartbeat, side-effect records, failure outcome, and later its success (artifact, step
    output, outcome) are all refused; attempt 2 completes the job, and its artifact is the
    job's and stays as it wrote it."""
    url = stack.env["CALMQ_DATABASE_URL"]
    _name, tenant_id, _key = new_tenant(stack, "fence-stale")
    job_id = _queued_job(url, tenant_id)

    async def scenario(w: _Attempts) -> dict[str, Any]:
        [stale] = await w.store.jobs.claim([job_id], "worker-a", 120.0)
        stale_effects = SideEffects(w.store, "worker-a", stale.lease_version)
        assert await stale_effects.called(str(job_id), "ledger") == 1  # it holds the job yet

        winner = _take_over(url, job_id, "worker-b")
        assert winner.lease_version > stale.lease_version

        assert await w.store.jobs.heartbeat({job_id: stale.lease_version}, "worker-a",
                                            120.0) == set()
        with pytest.raises(LeaseLost):
            await stale_effects.called(str(job_id), "ledger")
        with pytest.raises(LeaseLost):
            await stale_effects.confirmed(str(job_id), "ledger", {"posting": "stale"})
        failed = w.failures("worker-a").outcome(stale, "t", StepFailure(
            "the model was away", code="upstream_unavailable",
            failure_class=FailureClass.TRANSIENT))
        assert await w.store.attempts.finish([failed]) == set()
        assert _row(url, job_id)["status"] == "running"  # not moved to retrying

        assert await w.store.jobs.heartbeat({job_id: winner.lease_version}, "worker-b",
                                            120.0) == {job_id}
        assert await w.succeed(winner, "worker-b", "the winner's summary") == {job_id}
        won = _row(url, job_id)
        # The stale attempt's success comes last: its artifact goes to a key of its own.
        assert await w.succeed(stale, "worker-a", "the stale summary") == set()
        return won

    won = asyncio.run(_with_attempts(url, tmp_path, scenario))
    row = _row(url, job_id)
    assert row["status"] == "completed"
    assert row["artifact"] == won["artifact"]
    assert _read(row["artifact"]["uri"]) == {"summary": "the winner's summary"}
    assert row["outputs"] == [{"step": "second", "output": {"summary": "the winner's summary"}}]
    assert len(row["results"]) == 1
    outcomes = {a["worker"]: a["outcome"] for a in row["attempts"]}
    assert outcomes == {"worker-a": None, "worker-b": "completed"}
    assert row["effects"] == [{"key": "ledger", "state": "called", "calls": 1}]
    types = [e["type"] for e in history(url, str(job_id))]
    assert types.count("completed") == 1
    assert "retry_scheduled" not in types
    # The stale attempt's artifact exists beside the winner's, under its own token.
    artifacts = sorted(p.name for p in (tmp_path / str(tenant_id) / "artifacts").iterdir())
    assert len(artifacts) == 2
    assert all(name.startswith(f"{job_id}.second.") for name in artifacts)

    # Deleting the job deletes both: the stale one is named by its attempt row alone.
    async def delete(w: _Attempts) -> None:
        await purge(w.store, w.objects, Settings(object_store_url=tmp_path.as_uri()),
                    tenant_id, job_id)

    asyncio.run(_with_attempts(url, tmp_path, delete))
    assert list((tmp_path / str(tenant_id) / "artifacts").iterdir()) == []


def test_a_job_claimed_again_by_the_same_worker_id_is_not_the_old_attempts(
        stack: StackState, tmp_path: Path) -> None:
    """A worker restarted under the same id (a pod keeps its name) claims the job its old
    process held: the old attempt, though its worker id still matches lease_owner, can
    neither extend the new lease nor record its outcome, step output or artifact."""
    url = stack.env["CALMQ_DATABASE_URL"]
    _name, tenant_id, _key = new_tenant(stack, "fence-same")
    job_id = _queued_job(url, tenant_id)
    worker = f"pod-{uuid.uuid4().hex[:6]}-1"

    async def scenario(w: _Attempts) -> None:
        [old] = await w.store.jobs.claim([job_id], worker, 120.0)
        new = _take_over(url, job_id, worker)
        assert (new.attempt, old.attempt) == (2, 1)

        assert await w.store.jobs.heartbeat({job_id: old.lease_version}, worker,
                                            120.0) == set()
        assert await w.succeed(old, worker, "the old process's summary") == set()
        mid = _row(url, job_id)
        assert (mid["status"], mid["lease_owner"], mid["lease_version"]) == (
            "running", worker, new.lease_version)
        assert mid["artifact"] is None
        assert mid["outputs"] == []
        assert mid["results"] == []
        # The old process hands its leases back on its way out: not the new attempt's.
        assert await w.store.jobs.release_leases({job_id: old.lease_version}, worker) == set()

        assert await w.succeed(new, worker, "the new process's summary") == {job_id}

    asyncio.run(_with_attempts(url, tmp_path, scenario))
    row = _row(url, job_id)
    assert row["status"] == "completed"
    assert _read(row["artifact"]["uri"]) == {"summary": "the new process's summary"}
    assert row["outputs"] == [{"step": "second",
                               "output": {"summary": "the new process's summary"}}]
    assert len(row["results"]) == 1
    assert [(a["attempt"], a["outcome"]) for a in row["attempts"]] == [(1, None),
                                                                       (2, "completed")]


# -- self-fencing ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from forwarded_env(stack, tmp_path_factory.mktemp("fencing-logs"))


LEASE = 3.0
FENCED = {**BASE, "lease_seconds": str(LEASE), "grace_seconds": "1",
          "workflow_modules": "tests.support.fencing_workflows"}


def _lease_expiry(url: str, job_id: str) -> tuple[str | None, float | None]:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT lease_owner, extract(epoch FROM lease_expires_at)::float8"
                           " FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None
    return row[0], row[1]


def _partition_of(bootstrap: str, topic: str) -> int:
    """The partition holding the one message of a new topic (the job's)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4()}"})
    try:
        for partition in (0, 1):
            _low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                        timeout=10)
            if high > 0:
                return partition
    finally:
        consumer.close()
    raise AssertionError(f"no message on {topic}")


def _committed(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        return {tp.partition: tp.offset for tp in consumer.committed(
            [TopicPartition(topic, p) for p in (0, 1)], timeout=10)}
    finally:
        consumer.close()


def test_a_worker_cut_off_from_the_database_stops_its_attempts_before_the_lease_runs_out(
        env: Env, tmp_path: Path) -> None:
    """A worker whose database connections are cut mid-step stops the attempt itself, before
    the lease it can no longer extend runs out, and leaves the message's offset uncommitted.
    Another worker then completes the job exactly once."""
    db = urlparse(env.db)
    pool = env.pool("fence")
    topic = f"calmq.{pool}.interactive"
    with FaultProxy(db.hostname or "127.0.0.1", db.port or 5432) as proxy:
        proxied = db._replace(netloc=db.netloc.replace(f":{db.port}", f":{proxy.port}"))
        cut_off, port = env.procs.worker(pool, database_url=proxied.geturl(), **FENCED)
        [job_id] = submit(env.db, env.tenant, pool, [{"text": "held, then fenced",
                                                      "notes": str(tmp_path)}],
                          workflow=fencing_workflows.NAME)
        wait_for((tmp_path / "started").exists, timeout=60,
                 what="the first attempt to start its step")
        proxy.cut()

        wait_for((tmp_path / "stopped").exists, timeout=4 * LEASE,
                 what="the cut-off worker to stop its attempt")
        stopped_at = float((tmp_path / "stopped").read_text())
        owner, expires = _lease_expiry(env.db, job_id)
        assert owner is not None
        assert expires is not None
        assert stopped_at < expires, "the attempt ran on after its lease could be taken over"
        assert (metric(port, "calmq_attempts_fenced_total") or 0) == 1

        # Its offset stays uncommitted: two unreadable messages after it, one on each
        # partition, are acknowledged by the cut-off worker (no database needed); the other
        # partition's commit moves past its one, the job's partition's does not.
        partition = _partition_of(env.bootstrap, topic)
        producer = Producer({"bootstrap.servers": env.bootstrap})
        for p in (0, 1):
            producer.produce(topic, value=b"not avro " + uuid.uuid4().bytes, partition=p)
        assert producer.flush(10) == 0
        group = f"calmq.{pool}"
        wait_for(lambda: _committed(env.bootstrap, group, topic)[1 - partition] >= 1,
                 timeout=30, what="the cut-off worker to commit the other partition")
        assert _committed(env.bootstrap, group, topic)[partition] <= 0
        assert _lease_expiry(env.db, job_id)[0] == owner  # nothing written meanwhile

        cut_off.send_signal(signal.SIGKILL)
        cut_off.wait(timeout=10)
        _other, other_port = env.procs.worker(pool, **FENCED)
        job = env.finished(job_id, timeout=90)

    assert job["status"] == "completed"
    events = history(env.db, job_id)
    assert [e["type"] for e in events].count("completed") == 1
    with psycopg.connect(env.db, row_factory=dict_row) as conn:
        attempts = conn.execute("SELECT attempt, worker, outcome FROM job_attempts"
                                " WHERE job_id = %s ORDER BY attempt", (job_id,)).fetchall()
        results = conn.execute("SELECT count(*) AS n FROM outbox WHERE aggregateid = %s"
                               " AND type = 'job.result'", (job_id,)).fetchone()
    assert results is not None
    assert results["n"] == 1
    assert attempts[0]["worker"] == owner
    assert attempts[0]["outcome"] != "completed"
    assert [a for a in attempts if a["outcome"] == "completed"] == [attempts[-1]]
    assert attempts[-1]["worker"] != owner
    assert (metric(other_port, "calmq_attempts_fenced_total") or 0) == 0


def test_an_attempt_whose_lease_was_taken_over_makes_no_external_call(
        env: Env, tmp_path: Path) -> None:
    """A worker's attempt whose job was taken over (its lease ran out, another claim took
    it) while it was in its step reaches the side-effect log: the log refuses it, so the
    external call is never made, and the attempt ends with no outcome."""
    pool = env.pool("effect")
    # A long lease: the worker's heartbeat (every third of it) does not notice the take-over
    # first; the write it makes does.
    _proc, port = env.procs.worker(pool, **{**FENCED, "lease_seconds": "300"})
    [job_id] = submit(env.db, env.tenant, pool, [{"text": "post once", "notes": str(tmp_path)}],
                      workflow=fencing_workflows.EFFECT)
    wait_for((tmp_path / "started").exists, timeout=60, what="the attempt to start its step")
    winner = _take_over(env.db, uuid.UUID(job_id), "intruder")
    (tmp_path / "go").write_text("")

    wait_for(lambda: (metric(port, "calmq_attempts_fenced_total") or 0) >= 1, timeout=30,
             what="the worker to fence the stale attempt's write")
    assert not (tmp_path / "called").exists()
    row = _row(env.db, uuid.UUID(job_id))
    assert (row["status"], row["lease_owner"], row["lease_version"]) == (
        "running", "intruder", winner.lease_version)
    assert row["effects"] == []
    assert row["results"] == []
    assert (metric(port, "calmq_attempts_finished_total") or 0) == 0
    assert (metric(port, "calmq_attempts_aborted_total") or 0) == 0
    assert env.api.call("POST", f"/v1/jobs/{job_id}/cancel")[0] in (200, 202)


def test_a_worker_whose_database_comes_back_runs_its_fenced_job_again_once(
        env: Env, tmp_path: Path) -> None:
    """The database answers again soon after the worker stopped its attempt: the worker hands
    the lease back (the attempt is marked released, not failed) and claims the message
    again, running the job once more to completion; the partition's commit then moves past
    the message."""
    db = urlparse(env.db)
    pool = env.pool("fenceback")
    topic = f"calmq.{pool}.interactive"
    with FaultProxy(db.hostname or "127.0.0.1", db.port or 5432) as proxy:
        proxied = db._replace(netloc=db.netloc.replace(f":{db.port}", f":{proxy.port}"))
        _proc, port = env.procs.worker(pool, database_url=proxied.geturl(), **FENCED)
        [job_id] = submit(env.db, env.tenant, pool, [{"text": "fenced, then run again",
                                                      "notes": str(tmp_path)}],
                          workflow=fencing_workflows.NAME)
        wait_for((tmp_path / "started").exists, timeout=60,
                 what="the first attempt to start its step")
        proxy.cut()
        wait_for((tmp_path / "stopped").exists, timeout=4 * LEASE,
                 what="the cut-off worker to stop its attempt")
        proxy.restore()
        job = env.finished(job_id, timeout=60)
        partition = _partition_of(env.bootstrap, topic)
        wait_for(lambda: _committed(env.bootstrap, f"calmq.{pool}", topic)[partition] >= 1,
                 timeout=30, what="the partition's commit to move past the message")

    assert job["status"] == "completed"
    with psycopg.connect(env.db, row_factory=dict_row) as conn:
        attempts = conn.execute("SELECT attempt, outcome FROM job_attempts WHERE job_id = %s"
                                " ORDER BY attempt", (job_id,)).fetchall()
    # Released by the hand-back; or, had a reaper of the stack found the lease expired
    # before the worker reconnected, abandoned. Never an outcome of the job's.
    assert attempts[0]["outcome"] in ("released", "abandoned")
    assert [(a["attempt"], a["outcome"]) for a in attempts[1:]] == [(2, "completed")]
    assert [e["type"] for e in history(env.db, job_id)].count("completed") == 1
    assert (metric(port, "calmq_attempts_fenced_total") or 0) == 1
