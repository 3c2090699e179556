"""A W3C traceparent sent on submit travels with the job: in the Kafka headers of every event
of the job and in the worker's JSON log lines for it."""

from __future__ import annotations

import json
import secrets
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from calmq import topics
from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


def _ends(consumer: Consumer, names: list[str]) -> list[TopicPartition]:
    """Every partition of ``names`` positioned at its current end."""
    out = []
    for name in names:
        meta = consumer.list_topics(name, timeout=10).topics[name]
        for p in meta.partitions:
            _low, high = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=10)
            out.append(TopicPartition(name, p, high))
    return out


def _collect(consumer: Consumer, job_ids: set[str], found: dict[tuple[str, str], Any]) -> bool:
    """Read what is there; keep (job id, topic) -> headers of the jobs' events."""
    for msg in consumer.consume(500, timeout=0.2):
        key = (msg.key() or b"").decode()
        if msg.error() is None and key in job_ids:
            found[(key, str(msg.topic()))] = dict(msg.headers() or [])
    return False


def test_traceparent_is_on_the_jobs_kafka_events_and_worker_log_lines(
        stack: StackState) -> None:
    """A submit's traceparent is on the job's Kafka events and in the worker's log lines for it."""
    api = Api(stack.env["CALMQ_API_URL"],
              create_tenant(stack.env["CALMQ_DATABASE_URL"], f"trace-{uuid.uuid4().hex[:8]}"))
    trace = secrets.token_hex(16)
    traceparent = f"00-{trace}-{secrets.token_hex(8)}-01"
    work = topics.topic_for_route(topics.work_route("default", "bulk"))
    results = topics.topic_for_route(topics.RESULTS_ROUTE)
    dlq = topics.topic_for_route(topics.DLQ_ROUTE)
    retry = topics.topic_for_route(topics.retry_route("5s"))  # the stack's first tier
    consumer = Consumer({"bootstrap.servers": stack.env["CALMQ_KAFKA_BOOTSTRAP"],
                         "group.id": f"trace-test-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    try:
        consumer.assign(_ends(consumer, [work, results, dlq, retry]))
        ids: dict[str, str] = {}
        for name, data in (("ok", {"text": "traced"}),
                           ("dead", {"text": "traced", "mode": "bad_request"}),
                           ("retried", {"text": "traced", "mode": "flaky", "fail_times": 1})):
            status, _h, body = api.call("POST", "/v1/jobs",
                                        {"workflow": "summarize", "input": data},
                                        headers={"traceparent": traceparent})
            assert status == 202, body
            ids[name] = body["job_id"]
        wanted = {(ids["ok"], work), (ids["ok"], results), (ids["dead"], work),
                  (ids["dead"], results), (ids["dead"], dlq), (ids["retried"], retry)}
        found: dict[tuple[str, str], Any] = {}
        wait_for(lambda: _collect(consumer, set(ids.values()), found) or wanted <= found.keys(),
                 timeout=60, what="the jobs' events on work, retry, result and DLQ topics")
    finally:
        consumer.close()
    for key in wanted:
        assert found[key].get("traceparent") == traceparent.encode(), key

    log = Path(stack.data_dir) / "logs" / "worker.log"

    def lines() -> list[dict[str, Any]]:
        out = []
        for raw in log.read_text(errors="replace").splitlines():
            if raw.startswith("{") and trace in raw:
                out.append(json.loads(raw))
        return out

    traced = wait_for(lambda: {line.get("job_id") for line in lines()} >= set(ids.values())
                      and lines(), timeout=30, what="worker log lines with the trace id")
    for line in traced:
        assert line["trace_id"] == trace
        assert line["job_id"] in ids.values()
        assert line["attempt"] >= 1
