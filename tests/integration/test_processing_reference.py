"""The reference cases of the processing engine, through the real broker and database.

Each case runs on its own test pool (calmq.<pool>.interactive/bulk) served by worker and
forwarder processes this module starts with its own settings, so the stack's default worker
never takes these jobs. Jobs are written with calmq.data.insert_job (as the API writes them,
with the pool chosen by the test; see tests/support/workers.py); their status is read over
HTTP.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from calmq.codec import make_codec
from calmq.tooling.devstack import StackState
from tests.support.api import lifecycle
from tests.support.waiting import wait_for
from tests.support.workers import (
    BASE,
    TERMINAL,
    Env,
    fake_stats,
    forwarded_env,
    history,
    job_rows,
)

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def env(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from forwarded_env(stack, tmp_path_factory.mktemp("processing-logs"))


@pytest.fixture(scope="module")
def pool(env: Env) -> str:
    """A pool served by one worker with the default step timeout and job budgets."""
    name = env.pool("ref")
    env.procs.worker(name, **BASE)
    return name


def _types(job: dict[str, Any]) -> list[str]:
    return lifecycle(job["events"])


def test_success_completes_in_one_attempt_with_artifact(env: Env, pool: str) -> None:
    """mode=success ends completed after 1 attempt, with its artifact written."""
    (job_id,) = env.submit(pool, {"text": "A short text to summarize.", "mode": "success"})
    job = env.finished(job_id)
    assert job["status"] == "completed"
    assert job["attempt"] == 1
    assert _types(job) == ["queued", "running", "completed"]
    uri = job["artifact"]["uri"]
    assert uri.startswith("file://")
    assert '"summary"' in Path(uri.removeprefix("file://")).read_text()


def test_slow_step_times_out_twice_then_dead_letters(env: Env) -> None:
    """mode=slow with a 10 ms step timeout and a 2-attempt budget: dead_letter, timeout x2."""
    slow_pool = env.pool("slow")
    env.procs.worker(slow_pool, **BASE, step_timeout_seconds="0.01", max_attempts="2")
    (job_id,) = env.submit(slow_pool, {"text": "take your time", "mode": "slow"})
    job = env.finished(job_id)
    assert job["status"] == "dead_letter"
    assert job["attempt"] == 2
    errors = job_rows(env.db, [job_id])[job_id]["errors"]
    assert [e["code"] for e in errors] == ["timeout", "timeout"]
    assert {e["class"] for e in errors} == {"transient"}
    assert _types(job) == ["queued", "running", "retry_scheduled", "running", "dead_lettered"]


def test_malformed_output_dead_letters_after_one_attempt(env: Env, pool: str) -> None:
    """mode=malformed: dead_letter after 1 attempt, class verifier, no retry scheduled."""
    (job_id,) = env.submit(pool, {"text": "answer in prose", "mode": "malformed"})
    job = env.finished(job_id)
    assert job["status"] == "dead_letter"
    assert job["attempt"] == 1
    assert job["error"]["class"] == "verifier"
    assert job["error"]["code"] == "malformed_output"
    assert _types(job) == ["queued", "running", "dead_lettered"]


def test_killed_worker_job_completes_on_a_new_worker(env: Env) -> None:
    """kill -9 of a worker mid-call: a new worker completes the job, history says requeued."""
    restart_pool = env.pool("restart")
    first, _port = env.procs.worker(restart_pool, **BASE)
    (job_id,) = env.submit(restart_pool, {"text": "survive a crash", "mode": "success",
                                          "delay_ms": 1500})
    fake = env.stack.env["CALMQ_FAKE_PROVIDER_URL"]
    wait_for(lambda: fake_stats(fake)["by_job"].get(job_id, {}).get("calls"), timeout=30,
             what="the first worker's model call to start")
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    env.procs.worker(restart_pool, **BASE)
    job = env.finished(job_id)
    assert job["status"] == "completed"
    assert _types(job) == ["queued", "running", "requeued_after_restart", "running", "completed"]
    workers = [e["detail"]["worker"] for e in job["events"] if e["type"] == "running"]
    assert workers[0] != workers[1]
    assert fake_stats(fake)["by_job"][job_id]["calls"] == 2  # the killed call, then the rerun


def test_polling_reads_queued_then_running_then_completed(env: Env) -> None:
    """GET /v1/jobs/{id} reads queued, then running, then completed, in that order."""
    poll_pool = env.pool("poll")
    (job_id,) = env.submit(poll_pool, {"text": "watch me", "mode": "success", "delay_ms": 1000})
    seen = [env.api.job(job_id)["status"]]  # no worker serves this pool yet: still queued
    env.procs.worker(poll_pool, **BASE)

    def done() -> bool:
        status = env.api.job(job_id)["status"]
        if status != seen[-1]:
            seen.append(status)
        return status in TERMINAL

    wait_for(done, timeout=60, what="the job to finish")
    assert seen == ["queued", "running", "completed"]


def test_always_fail_spends_three_attempts_with_growing_delays(env: Env, pool: str) -> None:
    """always_fail with a 3-attempt budget: dead_letter after exactly 3 attempts,
    upstream_unavailable x3, each retry waits at least its delay, and the delays grow."""
    (job_id,) = env.submit(pool, {"text": "never works", "mode": "always_fail"})
    job = env.finished(job_id, timeout=90)
    assert job["status"] == "dead_letter"
    assert job["attempt"] == 3
    errors = job_rows(env.db, [job_id])[job_id]["errors"]
    assert [e["code"] for e in errors] == ["upstream_unavailable"] * 3
    events = history(env.db, job_id)
    assert [e["type"] for e in events] == ["queued", "running", "retry_scheduled", "running",
                                           "retry_scheduled", "running", "dead_lettered"]
    delays = [e["detail"]["delay_seconds"] for e in events if e["type"] == "retry_scheduled"]
    assert delays[0] < delays[1]
    waited = [_seconds(events[i + 1]["at"], events[i]["at"])
              for i, e in enumerate(events) if e["type"] == "retry_scheduled"]
    for delay, gap in zip(delays, waited, strict=True):
        assert gap >= delay - 0.01  # the forwarder never republishes before the due time
    assert fake_stats(env.stack.env["CALMQ_FAKE_PROVIDER_URL"])["by_job"][job_id]["calls"] == 3
    dead = _dlq_record(env, job_id)
    assert [e["code"] for e in dead["errors"]] == ["upstream_unavailable"] * 3
    assert dead["last_event"] == "dead_lettered"


def _seconds(later: datetime, earlier: datetime) -> float:
    return (later - earlier).total_seconds()


def _dlq_record(env: Env, job_id: str) -> dict[str, Any]:
    codec = make_codec(env.stack.env["CALMQ_SCHEMA_REGISTRY_URL"])
    consumer = Consumer({"bootstrap.servers": env.bootstrap, "group.id": f"t-{uuid.uuid4()}",
                         "auto.offset.reset": "earliest"})
    found: dict[str, Any] = {}
    try:
        meta = consumer.list_topics("calmq.dlq", timeout=10)
        consumer.assign([TopicPartition("calmq.dlq", p, 0)
                         for p in meta.topics["calmq.dlq"].partitions])

        def seen() -> bool:
            for msg in consumer.consume(200, timeout=0.2):
                if msg.error() is None and msg.key() == job_id.encode():
                    found.update(codec.decode(msg.value() or b"")[1])
            return bool(found)

        wait_for(seen, timeout=30, what=f"job {job_id} on calmq.dlq")
    finally:
        consumer.close()
    return found
