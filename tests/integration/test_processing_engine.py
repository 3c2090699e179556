"""The processing engine beyond the reference cases: every fake-provider mode through a real
worker, cancellation, poison messages, interactive ahead of bulk, graceful SIGTERM."""

from __future__ import annotations

import signal
import struct
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from psycopg.types.json import Jsonb

from calmq import events
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
    metric,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from forwarded_env(stack, tmp_path_factory.mktemp("engine-logs"))


@pytest.fixture(scope="module")
def served(env: Env) -> tuple[str, int]:
    """A pool with one worker; returns the pool and the worker's metrics port."""
    pool = env.pool("eng")
    # A model of its own: a 401 blocks (provider, model) fleet-wide, and must not block the
    # session's other workers, which call the same fake provider for fake-small.
    _proc, port = env.procs.worker(pool, **BASE, model="fake-engine",
                                   provider_probe_seconds="1")
    return pool, port


def _types(events: list[dict[str, Any]]) -> list[str]:
    return lifecycle(events)


@pytest.mark.parametrize(
    ("data", "status", "attempts", "codes", "failure_class"),
    [
        ({"mode": "flaky", "fail_times": 1}, "completed", 2, ["upstream_unavailable"], None),
        ({"mode": "success", "delay_ms": 300}, "completed", 1, [], None),
        ({"mode": "rate_limited"}, "dead_letter", 3, ["rate_limited"] * 3, "transient"),
        ({"mode": "low_confidence"}, "awaiting_review", 1, [], None),
        ({"mode": "refusal"}, "dead_letter", 1, ["model_refusal"], "policy"),
        ({"mode": "bad_request"}, "dead_letter", 1, ["provider_bad_request"], "input"),
        ({"mode": "context_length"}, "dead_letter", 1, ["context_length_exceeded"], "input"),
    ],
    ids=["flaky", "delay_ms", "rate_limited", "low_confidence", "refusal", "bad_request",
         "context_length"],
)
def test_fake_provider_mode_through_the_worker(
    env: Env, served: tuple[str, int], data: dict[str, Any], status: str, attempts: int,
    codes: list[str], failure_class: str | None,
) -> None:
    """Each fake-provider mode ends in its status, attempt count and error classes."""
    (job_id,) = env.submit(served[0], {"text": "mode check", **data})
    job = wait_for(lambda: (j := env.api.job(job_id))["status"] in (*TERMINAL, "awaiting_review")
                   and j, timeout=60, what=f"job {job_id} to settle")
    assert job["status"] == status
    assert job["attempt"] == attempts
    row = job_rows(env.db, [job_id])[job_id]
    assert [e["code"] for e in row["errors"]] == codes
    if failure_class is not None:
        assert job["error"]["class"] == failure_class
    if data["mode"] == "rate_limited":
        # Retry-After (1 s from the fake provider) is a floor under every retry's delay.
        delays = [e["detail"]["delay_seconds"] for e in history(env.db, job_id)
                  if e["type"] == "retry_scheduled"]
        assert len(delays) == 2
        assert min(delays) >= 1.0


def test_a_401_only_one_jobs_request_meets_is_that_jobs_own(env: Env,
                                                            served: tuple[str, int]) -> None:
    """A 401 (mode unauthorized) that only this job's request meets, while the probe call
    is answered, blocks nothing: the job ends in dead_letter (provider_auth, permission) at
    its first attempt, never waits as provider_blocked, and the worker's metric names no
    block."""
    (job_id,) = env.submit(served[0], {"text": "bad key", "mode": "unauthorized"})
    job = env.finished(job_id)
    assert job["status"] == "dead_letter"
    assert (job["error"]["code"], job["error"]["class"], job["attempt"]) == (
        "provider_auth", "permission", 1)
    assert [e for e in history(env.db, job_id) if e["type"] == "waiting"
            and e["detail"].get("reason") == "provider_blocked"] == []
    assert (metric(served[1], "calmq_provider_blocked") or 0) == 0


def test_cancel_skips_queued_job_and_aborts_running_one(env: Env) -> None:
    """A job cancelled while queued is never called; one cancelled mid-call is aborted at
    the next heartbeat and its answer discarded."""
    pool = env.pool("cancel")
    (queued_id,) = env.submit(pool, {"text": "cancel me early", "mode": "success"})
    assert env.api.call("POST", f"/v1/jobs/{queued_id}/cancel")[0] in (200, 202)
    _proc, port = env.procs.worker(pool, **BASE)
    (running_id,) = env.submit(pool, {"text": "cancel me late", "mode": "success",
                                      "delay_ms": 2500})
    fake = env.stack.env["CALMQ_FAKE_PROVIDER_URL"]
    wait_for(lambda: fake_stats(fake)["by_job"].get(running_id, {}).get("calls"), timeout=30,
             what="the model call to start")
    assert env.api.call("POST", f"/v1/jobs/{running_id}/cancel")[0] in (200, 202)
    wait_for(lambda: (metric(port, "calmq_attempts_aborted_total") or 0) >= 1, timeout=10,
             what="the worker to abort the cancelled attempt")
    wait_for(lambda: fake_stats(fake)["by_job"][running_id]["completed"] == 1, timeout=10,
             what="the provider to answer the aborted call")
    wait_for(lambda: (metric(port, "calmq_redeliveries_acked_total") or 0) >= 1, timeout=30,
             what="the queued job's message to be acknowledged without a call")
    assert queued_id not in fake_stats(fake)["by_job"]
    rows = job_rows(env.db, [queued_id, running_id])
    assert rows[running_id]["status"] == "cancelled"
    assert rows[running_id]["artifact"] is None
    assert _types(history(env.db, running_id)) == ["queued", "running", "cancelled"]
    assert _types(history(env.db, queued_id)) == ["queued", "cancelled"]


def test_poison_messages_go_to_the_dlq_and_the_worker_keeps_going(env: Env) -> None:
    """Undecodable bytes, an unknown schema id and an unknown workflow each reach calmq.dlq
    with their reason; the worker stays up and completes the next job."""
    pool = env.pool("poison")
    proc, port = env.procs.worker(pool, **BASE)
    topic = f"calmq.{pool}.interactive"
    garbage = b"this is not avro " + uuid.uuid4().hex.encode()
    unknown_schema = b"\x00" + struct.pack(">I", 987654) + uuid.uuid4().bytes
    producer = Producer({"bootstrap.servers": env.bootstrap})
    for value in (garbage, unknown_schema):
        producer.produce(topic, value=value, key=b"poison")
    assert producer.flush(10) == 0
    (unknown_wf,) = env.submit(pool, {"text": "who runs me"}, workflow="no_such_workflow")
    (good,) = env.submit(pool, {"text": "after the poison", "mode": "success"})

    assert env.finished(good)["status"] == "completed"
    assert proc.poll() is None
    job = env.finished(unknown_wf)
    assert job["status"] == "dead_letter"
    assert job["error"]["code"] == "unknown_workflow"
    reasons = _dlq_reasons(env, topic, {garbage, unknown_schema})
    assert reasons == {garbage: "undecodable", unknown_schema: "unknown_schema"}
    assert (metric(port, "calmq_poison_messages_total") or 0) >= 2


def _dlq_reasons(env: Env, source: str, raws: set[bytes]) -> dict[bytes, str]:
    codec = make_codec(env.stack.env["CALMQ_SCHEMA_REGISTRY_URL"])
    consumer = Consumer({"bootstrap.servers": env.bootstrap, "group.id": f"t-{uuid.uuid4()}",
                         "auto.offset.reset": "earliest"})
    found: dict[bytes, str] = {}
    try:
        meta = consumer.list_topics("calmq.dlq", timeout=10)
        consumer.assign([TopicPartition("calmq.dlq", p, 0)
                         for p in meta.topics["calmq.dlq"].partitions])

        def seen() -> bool:
            for msg in consumer.consume(500, timeout=0.2):
                if msg.error() is not None:
                    continue
                _type, dead = codec.decode(msg.value() or b"")
                if dead.get("source_topic") == source and dead.get("raw_value") in raws:
                    found[dead["raw_value"]] = dead["errors"][0]["code"]
            return len(found) == len(raws)

        wait_for(seen, timeout=30, what="the poison messages on calmq.dlq")
    finally:
        consumer.close()
    return found


def test_interactive_jobs_overtake_bulk_when_the_worker_is_full(env: Env) -> None:
    """With the worker full of bulk work, an interactive job is fetched and finished while
    bulk jobs still wait."""
    pool = env.pool("prio")
    _proc, port = env.procs.worker(pool, **BASE, concurrency="2")
    bulk = env.submit(pool, *[{"text": f"bulk {i}", "mode": "success", "delay_ms": 3000}
                              for i in range(6)], priority="bulk")
    # Full: both call slots busy and one more bulk job claimed ahead (an eighth, at least 1).
    wait_for(lambda: metric(port, "calmq_worker_saturation") == 1.0
             and metric(port, "calmq_worker_in_flight") == 3, timeout=30,
             what="the worker to be full of bulk work")
    (interactive,) = env.submit(pool, {"text": "me first", "mode": "success"})
    assert env.finished(interactive)["status"] == "completed"
    rows = job_rows(env.db, bulk).values()
    # It did not wait behind the bulk work: at most the first two bulk calls (3 s each)
    # ended before it did, and bulk jobs are still waiting in Kafka, never claimed.
    assert sum(r["status"] == "completed" for r in rows) <= 2
    assert sum(r["status"] == "queued" for r in rows) >= 1
    for job_id in bulk:
        assert env.finished(job_id)["status"] == "completed"


def test_the_interactive_reserve_starts_a_burst_beside_a_worker_full_of_bulk_calls(
    env: Env,
) -> None:
    """CALMQ_INTERACTIVE_RESERVE: with both call slots held by long bulk calls, four
    interactive jobs all reach the provider while those calls still run (the default reserve
    of such a worker, one, starts one and queues three behind the bulk calls)."""
    pool = env.pool("reserve")
    _proc, port = env.procs.worker(pool, **BASE, concurrency="2", interactive_reserve="4")
    fake = env.stack.env["CALMQ_FAKE_PROVIDER_URL"]
    bulk = env.submit(pool, *[{"text": f"bulk {i}", "mode": "success", "delay_ms": 30000}
                              for i in range(4)], priority="bulk")
    wait_for(lambda: metric(port, "calmq_worker_saturation") == 1.0, timeout=30,
             what="both call slots held by bulk calls")
    # 12 s calls: one at a time through a single reserved slot, the second would start
    # 12 s after the first, past the deadline below.
    burst = env.submit(pool, *[{"text": f"now {i}", "mode": "success", "delay_ms": 12000}
                               for i in range(4)])

    def called(ids: list[str]) -> int:
        by_job = fake_stats(fake)["by_job"]
        return sum(1 for job_id in ids if by_job.get(job_id, {}).get("calls"))

    wait_for(lambda: called(burst) == 4, timeout=10,
             what="all four interactive calls started beside the bulk calls")
    # Still beside them: the bulk calls (30 s) have not ended, two are still unstarted.
    rows = job_rows(env.db, bulk).values()
    assert sum(r["status"] == "completed" for r in rows) == 0
    assert called(bulk) == 2
    for job_id in burst:
        assert env.finished(job_id)["status"] == "completed"


def test_sigterm_finishes_in_flight_work_within_the_grace_period(env: Env) -> None:
    """SIGTERM: the worker stops fetching, finishes what it runs, commits and exits 0."""
    pool = env.pool("term")
    proc, port = env.procs.worker(pool, **{**BASE, "grace_seconds": "15"})
    ids = env.submit(pool, *[{"text": f"finish me {i}", "mode": "success", "delay_ms": 1500}
                             for i in range(3)])
    wait_for(lambda: metric(port, "calmq_worker_in_flight") == 3, timeout=30,
             what="three jobs in flight")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    for job_id in ids:
        assert _types(history(env.db, job_id)) == ["queued", "running", "completed"]


def test_sigterm_past_the_grace_period_hands_work_to_the_next_worker(env: Env) -> None:
    """Work still running when the grace period ends is abandoned with its lease handed
    back, and the next worker completes it at once."""
    pool = env.pool("abandon")
    proc, _port = env.procs.worker(pool, **{**BASE, "grace_seconds": "0.3",
                                            "lease_seconds": "30"})
    # 8 s: long enough that a loaded machine's slow SIGTERM handling cannot let the first
    # worker finish the call itself, short enough to tell a released lease from an expired one.
    (job_id,) = env.submit(pool, {"text": "too slow to finish", "mode": "success",
                                  "delay_ms": 8000})
    fake = env.stack.env["CALMQ_FAKE_PROVIDER_URL"]
    wait_for(lambda: fake_stats(fake)["by_job"].get(job_id, {}).get("calls"), timeout=30,
             what="the model call to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    # Its lease expired on release: still running, or already requeued by a reaper.
    assert job_rows(env.db, [job_id])[job_id]["status"] in ("running", "queued")
    env.procs.worker(pool, **{**BASE, "lease_seconds": "30"})
    # With a 30 s lease, finishing well before it could expire shows the lease was released:
    # an unreleased lease would let the job be claimed 30 s after the first claim at the
    # earliest, and its 8 s call end past this deadline.
    job = env.finished(job_id, timeout=29)
    assert job["status"] == "completed"
    assert _types(job["events"]) == ["queued", "running", "requeued_after_restart", "running",
                                     "completed"]


def test_job_past_its_deadline_dead_letters_without_a_call(
    env: Env, served: tuple[str, int],
) -> None:
    """A job whose deadline passed before it ran ends dead_letter, class deadline, no call."""
    past = datetime.now(UTC) - timedelta(seconds=1)
    (job_id,) = env.submit(served[0], {"text": "too late", "mode": "success"}, deadline_at=past)
    job = env.finished(job_id)
    assert job["status"] == "dead_letter"
    assert job["error"]["class"] == "deadline"
    assert job_id not in fake_stats(env.stack.env["CALMQ_FAKE_PROVIDER_URL"])["by_job"]


def test_a_message_ahead_of_its_jobs_commit_is_claimed_once_the_job_is_visible(
    env: Env, served: tuple[str, int],
) -> None:
    """The relay may publish a transaction a moment before other sessions can see it. A
    worker that gets the message first must claim the job once it is visible, not drop the
    message as stale (it would stay queued for ever: that message is its only one), also
    when the transaction stays open past the ten claims (~4 s) a message used to get."""
    pool, port = served
    deferred = metric(port, "calmq_claims_deferred_total") or 0
    job_id = uuid.uuid4()
    row = {"id": job_id, "tenant_id": env.tenant, "workflow": "summarize",
           "workflow_version": 1, "step": "summarize", "attempt": 0, "priority": "interactive",
           "pool": pool, "input_ref": None, "deadline_at": None, "trace_parent": None}
    value = make_codec(env.stack.env["CALMQ_SCHEMA_REGISTRY_URL"]).encode(
        "job.requested", events.requested(row))
    with psycopg.connect(env.db) as conn:  # one transaction, committed when the block ends
        # The job and its history, but no outbox row: the message below is its only one.
        conn.execute(
            "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,"
            " pool, step, max_attempts, input) VALUES (%s, %s, 'summarize', 1, 'queued',"
            " 'interactive', %s, 'summarize', 3, %s)",
            (job_id, env.tenant, pool, Jsonb({"text": "early bird", "mode": "success"})))
        conn.execute("INSERT INTO job_events (job_id, type, attempt, detail)"
                     " VALUES (%s, 'queued', 0, '{}')", (job_id,))
        producer = Producer({"bootstrap.servers": env.bootstrap})
        producer.produce(f"calmq.{pool}.interactive", value=value, key=str(job_id).encode())
        assert producer.flush(10) == 0
        wait_for(lambda: (metric(port, "calmq_claims_deferred_total") or 0) > deferred + 10,
                 timeout=30, what="the worker to defer the message past the old bound")
    assert env.finished(str(job_id))["status"] == "completed"
    assert _types(history(env.db, str(job_id))) == ["queued", "running", "completed"]


def test_a_redrive_message_ahead_of_the_redrive_commit_is_claimed_once_visible(
    env: Env, served: tuple[str, int],
) -> None:
    """A redrive's job.requested can reach a worker before the redrive's commit is visible
    to it: the worker still sees the dead letter. It must claim the job once the redrive is
    visible, not acknowledge the message as stale (the redriven job would wait for ever)."""
    pool, port = served
    deferred = metric(port, "calmq_claims_deferred_total") or 0
    job_id = uuid.uuid4()
    with psycopg.connect(env.db) as conn:  # the dead letter, committed
        conn.execute(
            "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,"
            " pool, step, max_attempts, attempt, input) VALUES (%s, %s, 'summarize', 1,"
            " 'dead_letter', 'interactive', %s, 'summarize', 3, 3, %s)",
            (job_id, env.tenant, pool, Jsonb({"text": "second chance", "mode": "success"})))
        conn.execute("INSERT INTO job_events (job_id, type, attempt, detail)"
                     " VALUES (%s, 'queued', 0, '{}'), (%s, 'dead_letter', 3, '{}')",
                     (job_id, job_id))
    row = {"id": job_id, "tenant_id": env.tenant, "workflow": "summarize",
           "workflow_version": 1, "step": "summarize", "attempt": 0, "priority": "interactive",
           "pool": pool, "input_ref": None, "deadline_at": None, "trace_parent": None}
    value = make_codec(env.stack.env["CALMQ_SCHEMA_REGISTRY_URL"]).encode(
        "job.requested", events.requested(row))
    with psycopg.connect(env.db) as conn:  # the redrive, committed when the block ends
        conn.execute("UPDATE jobs SET status = 'queued', attempt = 0 WHERE id = %s", (job_id,))
        conn.execute("INSERT INTO job_events (job_id, type, attempt, detail)"
                     " VALUES (%s, 'redriven', 0, '{}')", (job_id,))
        producer = Producer({"bootstrap.servers": env.bootstrap})
        producer.produce(f"calmq.{pool}.interactive", value=value, key=str(job_id).encode())
        assert producer.flush(10) == 0
        wait_for(lambda: (metric(port, "calmq_claims_deferred_total") or 0) > deferred,
                 timeout=30, what="the worker to see the dead letter still")
    assert env.finished(str(job_id))["status"] == "completed"
    assert _types(history(env.db, str(job_id)))[-3:] == ["redriven", "running", "completed"]


def test_redelivered_message_of_a_finished_job_makes_no_call(
    env: Env, served: tuple[str, int],
) -> None:
    """A second job.requested for a completed job is acknowledged without a model call."""
    pool, port = served
    (job_id,) = env.submit(pool, {"text": "only once", "mode": "success"})
    assert env.finished(job_id)["status"] == "completed"
    fake = env.stack.env["CALMQ_FAKE_PROVIDER_URL"]
    assert fake_stats(fake)["by_job"][job_id]["calls"] == 1
    skipped = metric(port, "calmq_redeliveries_acked_total") or 0
    row = {"id": job_id, "tenant_id": str(env.tenant), "workflow": "summarize",
           "workflow_version": 1, "step": "summarize", "attempt": 0, "priority": "interactive",
           "pool": pool, "input_ref": None, "deadline_at": None, "trace_parent": None}
    value = make_codec(env.stack.env["CALMQ_SCHEMA_REGISTRY_URL"]).encode(
        "job.requested", events.requested(row))
    producer = Producer({"bootstrap.servers": env.bootstrap})
    producer.produce(f"calmq.{pool}.interactive", value=value, key=job_id.encode())
    assert producer.flush(10) == 0
    wait_for(lambda: (metric(port, "calmq_redeliveries_acked_total") or 0) > skipped,
             timeout=30, what="the duplicate to be acknowledged")
    assert fake_stats(fake)["by_job"][job_id]["calls"] == 1
    assert [e["type"] for e in history(env.db, job_id)] == ["queued", "running", "completed"]


def test_an_artifact_write_that_fails_ends_the_attempt_and_frees_the_partition(
        env: Env, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A failing artifact write after the model call retries, then dead-letters as transient,
    and the worker's in-flight count and the partition go back to free."""
    # A file where the store's folder should be: every write raises NotADirectoryError.
    blocker = tmp_path_factory.mktemp("full-disk") / "not-a-folder"
    blocker.write_text("")
    pool = env.pool("art")
    _proc, port = env.procs.worker(pool, object_store_url=f"file://{blocker}/store", **BASE)
    first, second = env.submit(pool, {"text": "artifact fails", "mode": "success"},
                               {"text": "behind it", "mode": "success"})
    for job_id in (first, second):
        job = env.finished(job_id, timeout=90)
        assert job["status"] == "dead_letter"
        assert job["error"]["code"] == "artifact_write_failed"
        assert job["error"]["class"] == "transient"
        assert job["attempt"] == 3
    wait_for(lambda: metric(port, "calmq_worker_in_flight") == 0, timeout=30,
             what="the worker to hold no attempt")
