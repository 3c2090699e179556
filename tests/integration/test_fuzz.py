"""Fuzzing what calmq reads from outside: every topic it consumes, every HTTP endpoint.

Against the session stack's own worker (``default`` pool) and forwarder (retry tiers):
random bytes, valid-but-odd Avro (unknown jobs, absurd attempts, other event types, odd
strings) and retry messages with hostile headers. Afterwards no part has crashed, nothing
is stuck: a normal job submitted behind the fuzz completes, and the consumer groups commit
past every fuzzed offset. Then hypothesis-generated paths, query strings, headers and
bodies against every route of the API: never a 5xx.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calmq import events, topics
from calmq.codec import make_codec
from calmq.kafka import producer_config
from calmq.producers.routes import ROUTES
from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

_WORK = [topics.topic_for_route(topics.work_route("default", p)) for p in ("interactive", "bulk")]
_RETRY = topics.topic_for_route(topics.retry_route("5s"))


@pytest.fixture(scope="module")
def api(stack: StackState) -> Api:
    return Api(stack.env["CALMQ_API_URL"],
               create_tenant(stack.env["CALMQ_DATABASE_URL"], f"fuzz-{uuid.uuid4().hex[:8]}"))


@pytest.fixture(scope="module")
def producer(stack: StackState) -> Iterator[Producer]:
    p = Producer(producer_config(stack.env["CALMQ_KAFKA_BOOTSTRAP"]))
    yield p
    p.flush(10)


def _odd_requested(rng: random.Random) -> dict[str, Any]:
    """A job.requested that fits the schema but names nothing real, or something absurd."""
    odd_text = rng.choice(["", "\u0000", "\ud7ff" * 50, "x" * 10_000, "🙂", "../../etc"])
    job = {"id": uuid.uuid4(), "tenant_id": uuid.uuid4(), "workflow": rng.choice(
        ["summarize", "no-such-workflow", odd_text]), "workflow_version": rng.choice(
        [1, 0, -1, 2**31 - 1]), "step": rng.choice(["summarize", odd_text]),
        "attempt": rng.choice([0, 1, -5, 2**31 - 1]), "priority": "bulk", "pool": "default",
        "input_ref": rng.choice([None, "s3://nope/x", odd_text]), "deadline_at": None,
        "created_at": None, "trace_parent": rng.choice([None, odd_text, "00-zz"])}
    return events.requested(job)


def _records(stack: StackState) -> list[tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]]:
    rng = random.Random(20261202)
    codec = make_codec(stack.env["CALMQ_SCHEMA_REGISTRY_URL"])
    out: list[tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]] = []
    for i in range(60):
        topic = _WORK[i % 2]
        kind = i % 4
        if kind == 0:  # random bytes, sometimes shaped like the wire format
            value = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
            if i % 8 == 0:
                value = b"\x00" + value
        elif kind == 1:
            value = codec.encode("job.requested", _odd_requested(rng))
        elif kind == 2:  # a valid event of another type on a work topic
            value = codec.encode("job.result", events.result(
                {"id": uuid.uuid4(), "tenant_id": uuid.uuid4(), "workflow": "summarize",
                 "step": "summarize", "attempt": 1}, "completed"))
        else:
            value = b""
        key = rng.choice([None, b"", str(uuid.uuid4()).encode(), b"\xff\xfe"])
        out.append((topic, key, value, []))
    # Retry messages with hostile bookkeeping headers.
    valid = codec.encode("job.requested", _odd_requested(rng))
    for origin, due in [(None, None), (b"calmq.results", b"0"), (b"calmq.dlq", b"0"),
                        (b"calmq.nopool-xyz.bulk", b"0"), (_RETRY.encode(), b"0"),
                        (b"not-ours", b"0"), (_WORK[0].encode(), b"soon"),
                        (_WORK[0].encode(), b"-1"), (_WORK[1].encode(), b"99999999999999999"),
                        (b"\xff\xfe", b"\xff")]:
        headers = [(k, v) for k, v in (("calmq-origin-topic", origin),
                                       ("calmq-due-at", due)) if v is not None]
        out.append((_RETRY, str(uuid.uuid4()).encode(), valid, headers))
    return out


def _committed(stack: StackState, group: str,
               tps: list[TopicPartition]) -> dict[tuple[str, int], int]:
    c = Consumer({"bootstrap.servers": stack.env["CALMQ_KAFKA_BOOTSTRAP"], "group.id": group})
    try:
        return {(tp.topic, tp.partition): tp.offset for tp in c.committed(tps, timeout=10)}
    finally:
        c.close()


def test_fuzzed_topics_crash_nothing_and_stick_nothing(
    stack: StackState, api: Api, producer: Producer
) -> None:
    """Every fuzzed record is consumed and committed past; the parts stay up; a normal job
    behind the fuzz completes."""
    acked: dict[tuple[str, int], int] = {}

    def report(err: Any, msg: Any) -> None:
        assert err is None, err
        key = (msg.topic(), msg.partition())
        acked[key] = max(acked.get(key, -1), msg.offset())

    for topic, key, value, headers in _records(stack):
        producer.produce(topic, value=value, key=key, headers=headers, on_delivery=report)
    assert producer.flush(30) == 0
    job_id = api.submit({"text": "behind the fuzz", "mode": "success"})
    job = wait_for(lambda: (j := api.job(job_id))["status"] in
                   ("completed", "dead_letter", "cancelled") and j, timeout=90,
                   what="a normal job behind the fuzzed records")
    assert job["status"] == "completed"
    groups = dict.fromkeys(_WORK, "calmq.default") | {_RETRY: "calmq.forwarder"}
    for (topic, partition), last in acked.items():
        tp = [TopicPartition(topic, partition)]
        wait_for(lambda t=topic, tp=tp, last=last: _committed(stack, groups[t], tp)[
            (t, tp[0].partition)] > last, timeout=60,
            what=f"{groups[topic]} to commit past the fuzz on {topic}[{partition}]")
    for part in ("api", "worker", "forwarder", "relay"):
        url = next(p.address for p in stack.parts if p.name == part)
        if url.startswith("http"):
            with urllib.request.urlopen(url + ("/healthz" if part == "api" else "/metrics"),
                                        timeout=5) as resp:
                assert resp.status == 200, part


_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
                max_size=40)
_BYTES = st.binary(max_size=300)


def _path(template: str, rng_part: str) -> str:
    out = []
    for segment in template.split("/"):
        out.append(urllib.request.quote(rng_part, safe="") or "x"
                   if segment.startswith("{") else segment)
    return "/".join(out)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), segment=st.one_of(_TEXT, st.uuids().map(str)),
       query=st.dictionaries(_TEXT, _TEXT, max_size=4),
       header_value=st.binary(max_size=40), body=st.one_of(_BYTES, _TEXT.map(str.encode)),
       content_type=st.sampled_from(["application/json", "multipart/form-data",
                                     "multipart/form-data; boundary=xx", "text/plain", ""]),
       keyed=st.booleans())
def test_no_request_is_answered_with_a_5xx(
    api: Api, route: Any, segment: str, query: dict[str, str], header_value: bytes,
    body: bytes, content_type: str, keyed: bool,
) -> None:
    path = _path(route.path, segment)
    qs = urllib.parse.urlencode(query)
    headers = {"Content-Type": content_type,
               "Idempotency-Key": header_value.decode("latin-1"),
               "Last-Event-ID": header_value.decode("latin-1"),
               "traceparent": header_value.decode("latin-1")}
    if keyed:
        headers["Authorization"] = f"Bearer {api.key}"
    request = urllib.request.Request(
        f"{api.base_url}{path}{'?' + qs if qs else ''}", method=route.method,
        data=body if route.method in ("POST", "PUT", "PATCH") else None, headers={
            k: v for k, v in headers.items() if "\n" not in v and "\r" not in v})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            status = resp.status
            if "text/event-stream" in resp.headers.get("Content-Type", ""):
                return  # a live stream of a real job: answered, nothing to wait for
    except urllib.error.HTTPError as exc:
        status = exc.code
    assert status < 500, (route.method, path, qs, status)
    assert time.monotonic() - started < 30


# -- sizes and unstorable text (issue 27) ------------------------------------------------------

def _outbox_row(stack: StackState, payload: dict[str, Any], route: str, event_type: str) -> None:
    import psycopg
    from psycopg.types.json import Jsonb

    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute("INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)"
                     " VALUES (%s, %s, %s, %s, %s, %s)",
                     (payload["event_id"], route, payload["job_id"], event_type, Jsonb(payload),
                      Jsonb({})))


def test_fuzzed_event_sizes_stop_no_relay(stack: StackState, api: Api) -> None:
    """Outbox rows of random sizes around Kafka's limit (metadata of random non-ASCII text,
    escaped 6x in the event) are each published or rejected to calmq.dlq; the relay stays up
    and a normal job behind them completes. Metadata over the limit is refused at intake."""
    rng = random.Random(27)
    alphabet = "aé😀\u4e2d\u0001"
    for target in (500, 150_000, 170_000, 400_000, 1_200_000):
        text = "".join(rng.choice(alphabet) for _ in range(target // 6))
        job = str(uuid.uuid4())
        _outbox_row(stack, events.result({
            "id": job, "tenant_id": str(uuid.uuid4()), "workflow": "summarize",
            "step": "summarize", "attempt": 1, "metadata": {"t": text}}, "completed"),
            topics.RESULTS_ROUTE, "job.result")
        status, _h, body = api.call("POST", "/v1/jobs", {
            "workflow": "summarize", "input": {"text": "x"}, "metadata": {"t": text[:200_000]}})
        assert status in (202, 413), body
        if status == 413:
            assert body["code"] in ("metadata_too_large", "body_too_large")
    job_id = api.submit({"text": "behind the oversized events", "mode": "success"})
    done = wait_for(lambda: (j := api.job(job_id))["status"] in
                    ("completed", "dead_letter", "cancelled") and j, timeout=90,
                    what="a normal job behind the oversized events")
    assert done["status"] == "completed"
    relay = next(p.address for p in stack.parts if p.name == "relay")
    with urllib.request.urlopen(relay + "/metrics", timeout=5) as resp:
        assert resp.status == 200


def test_fuzzed_unstorable_model_outputs_end_every_job(stack: StackState, api: Api) -> None:
    """Uploaded inputs holding NULs and odd control text, in every output-bearing mode, all
    end (completed, or dead_letter as unstorable_output) with nothing stuck; a normal job
    behind them completes."""
    rng = random.Random(2027)
    boundary = "fuzzboundary"
    jobs = []
    for _ in range(12):
        words = [rng.choice(["a", "\u0000", "b\u0000c", "\u0001", "é", "😀", "\\u0000", "x"])
                 for _ in range(rng.randint(1, 8))]
        body = json.dumps({"text": " ".join(words) or "x",
                           "mode": rng.choice(["success", "low_confidence"])}).encode()
        raw = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"workflow\"\r\n\r\n"
               f"summarize\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\";"
               f" filename=\"in.json\"\r\nContent-Type: application/json\r\n\r\n").encode()
        raw += body + f"\r\n--{boundary}--\r\n".encode()
        status, _h, answer = api.call(
            "POST", "/v1/jobs", raw=raw,
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        assert status == 202, answer
        jobs.append(str(answer["job_id"]))
    behind = api.submit({"text": "behind the NULs", "mode": "success"})
    for job_id in [*jobs, behind]:
        job = wait_for(lambda j=job_id: (v := api.job(j))["status"] not in
                       ("queued", "running", "retrying") and v, timeout=90,
                       what=f"job {job_id} to end or wait for review")
        if job["status"] == "dead_letter":
            assert job["error"]["code"] == "unstorable_output", job["error"]
        else:
            assert job["status"] in ("completed", "awaiting_review"), job
    assert api.job(behind)["status"] == "completed"
