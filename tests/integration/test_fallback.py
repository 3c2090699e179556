"""Cooldowns and fallback across models on the real stack with two workers (issue 31): a 429
with Retry-After cools down the model it names fleet-wide; a step that allows another model
moves its calls there at once (no attempt burned, the served model recorded on the attempt,
in the result event's usage and in the cost); a step whose every model cools makes no call
and counts no attempt: its jobs wait in ``queued`` (``model_cooldown``) and run after."""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from calmq.codec import make_codec
from calmq.tooling.devstack import StackState, processes
from tests.support.api import Api
from tests.support.fallback_workflows import FALLBACK_POOL, FIRST, ONLY, SECOND
from tests.support.waiting import wait_for
from tests.support.workers import (
    Procs,
    all_completed,
    create_pool_topics,
    create_tenant_id,
    start_fake_provider,
)

pytestmark = pytest.mark.integration

PRICES = {FIRST: {"input": 0.15, "output": 0.60}, SECOND: {"input": 2.50, "output": 10.00},
          ONLY: {"input": 0.15, "output": 0.60}}


@dataclass
class Rig:
    api: Api
    db: str
    provider: str  # the fake provider's URL
    stack: StackState


@pytest.fixture(scope="module")
def rig(stack: StackState) -> Iterator[Rig]:
    log_dir = Path(tempfile.mkdtemp(prefix="calmq-fallback-logs-"))
    procs = Procs(stack.env, log_dir)
    pids: list[int] = []
    try:
        pid, url = start_fake_provider(log_dir, "--latency-ms", "100")
        pids.append(pid)
        create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], FALLBACK_POOL, ["1s"],
                           partitions=4)
        settings = {"workflow_modules": "tests.support.fallback_workflows",
                    "provider_url": url, "retry_tiers": "1s", "prices": json.dumps(PRICES)}
        api = procs.api(**settings)
        for _ in range(2):
            procs.worker(FALLBACK_POOL, concurrency="16", **settings)
        db = stack.env["CALMQ_DATABASE_URL"]
        _tenant, key = create_tenant_id(db, f"fallback-{uuid.uuid4().hex[:8]}")
        yield Rig(Api(api, key), db, url, stack)
    finally:
        procs.stop_all()
        for pid in pids:
            processes.stop(pid)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return dict(json.load(answer))


def _calls(rig: Rig, jobs: set[str]) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{rig.provider}/admin/calls", timeout=10) as answer:
        return [c for c in json.load(answer)["calls"] if c["job"] in jobs]


def _submit(rig: Rig, workflow: str, n: int) -> list[str]:
    ids = []
    for i in range(n):
        status, _h, body = rig.api.call("POST", "/v1/jobs", {
            "workflow": workflow, "input": {"text": f"fallback job {i:03d}"}})
        assert status == 202, body
        ids.append(str(body["job_id"]))
    return ids


def _results(stack: StackState, ids: list[str]) -> dict[str, dict[str, Any]]:
    """The jobs' result events, read from calmq.results and decoded with the registry."""
    codec = make_codec(stack.env["CALMQ_SCHEMA_REGISTRY_URL"])
    consumer = Consumer({"bootstrap.servers": stack.env["CALMQ_KAFKA_BOOTSTRAP"],
                         "group.id": f"t-{uuid.uuid4()}", "auto.offset.reset": "earliest"})
    found: dict[str, dict[str, Any]] = {}
    try:
        meta = consumer.list_topics("calmq.results", timeout=10)
        consumer.assign([TopicPartition("calmq.results", p, 0)
                         for p in meta.topics["calmq.results"].partitions])

        def seen() -> bool:
            for msg in consumer.consume(500, timeout=0.2):
                key = (msg.key() or b"").decode()
                if msg.error() is None and key in ids:
                    found[key] = codec.decode(msg.value())[1]
            return len(found) == len(ids)

        wait_for(seen, timeout=60, what="the jobs' results on calmq.results")
    finally:
        consumer.close()
    return found


def _uncounted(conn: psycopg.Connection[Any], ids: list[str]) -> None:
    """Each job ran once: attempt 1, one attempt row, no retry scheduled."""
    rows = conn.execute("SELECT j.attempt, (SELECT count(*) FROM job_attempts a"
                        " WHERE a.job_id = j.id) FROM jobs j WHERE j.id = ANY(%s::uuid[])",
                        (ids,)).fetchall()
    assert sorted(set(rows)) == [(1, 1)], rows
    retried = conn.execute("SELECT count(*) FROM job_events WHERE job_id = ANY(%s::uuid[])"
                           " AND type = 'retry_scheduled'", (ids,)).fetchone()
    assert retried == (0,)


def test_a_429_moves_the_calls_to_the_next_model_with_the_served_model_recorded(
        rig: Rig) -> None:
    _post(f"{rig.provider}/admin/outage", {"seconds": 120, "statuses": [429],
                                           "model": FIRST, "retry_after_seconds": 30})
    ids = _submit(rig, "summarize_fallback", 20)
    with psycopg.connect(rig.db, autocommit=True) as conn:
        wait_for(lambda: all_completed(conn, ids), timeout=90, what="the fallback jobs")
        _uncounted(conn, ids)  # the 429 burned no attempt: the same call moved on
        served = conn.execute("SELECT a.model, count(*) FROM job_attempts a"
                              " WHERE a.job_id = ANY(%s::uuid[]) GROUP BY 1", (ids,)).fetchall()
        assert served == [(SECOND, 20)]
        # The cost is the served model's price, not the first choice's.
        for tokens_in, tokens_out, cost in conn.execute(
                "SELECT input_tokens, output_tokens, cost_usd FROM jobs"
                " WHERE id = ANY(%s::uuid[])", (ids,)).fetchall():
            assert tokens_in > 0
            assert float(cost) == pytest.approx((tokens_in * 2.50 + tokens_out * 10.00) / 1e6)
    # The first 429 cooled the model fleet-wide: after a second, nobody called it.
    calls = _calls(rig, set(ids))
    first = sorted(c["at"] for c in calls if c["model"] == FIRST)
    assert first, "no call met the 429"
    assert [at for at in first if at > first[0] + 1.0] == []
    assert sum(c["model"] == SECOND for c in calls) == 20
    results = _results(rig.stack, ids)
    assert {r["usage"]["model"] for r in results.values()} == {SECOND}


def test_no_attempt_is_counted_while_every_allowed_model_cools(rig: Rig) -> None:
    _post(f"{rig.provider}/admin/outage", {"seconds": 2, "statuses": [429], "model": ONLY,
                                           "retry_after_seconds": 3})
    started = time.monotonic()
    ids = _submit(rig, "summarize_cooling", 10)
    with psycopg.connect(rig.db, autocommit=True) as conn:
        wait_for(lambda: all_completed(conn, ids), timeout=90, what="the cooling jobs")
        assert time.monotonic() - started >= 2.5  # they waited out the Retry-After
        _uncounted(conn, ids)
        waited = conn.execute(
            "SELECT count(DISTINCT job_id) FROM job_events WHERE job_id = ANY(%s::uuid[])"
            " AND type = 'waiting' AND detail ->> 'reason' = 'model_cooldown'",
            (ids,)).fetchone()
        assert waited is not None
        assert waited[0] >= 1, waited
        resumed = conn.execute(
            "SELECT count(DISTINCT job_id) FROM job_events WHERE job_id = ANY(%s::uuid[])"
            " AND type = 'resumed' AND detail ->> 'reason' = 'model_cooldown'",
            (ids,)).fetchone()
        assert resumed == waited
        served = conn.execute("SELECT DISTINCT model FROM job_attempts"
                              " WHERE job_id = ANY(%s::uuid[])", (ids,)).fetchall()
        assert served == [(ONLY,)]
