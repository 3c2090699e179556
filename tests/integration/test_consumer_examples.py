"""The downstream consumer examples (examples/consumers/{python,java,go}) against the real stack.

A mixed run goes through the API (completed, dead-lettered, reviewed then approved); each
example is built (Maven, the Go toolchain), run as a subprocess with its own consumer group
from the oldest result, and must agree with the API on every job of the run, printing a
redelivered result once. The examples print the tenant's results only (``CALMQ_TENANT_ID``),
so other tests' results do not count.

Builds are cached under ``$XDG_CACHE_HOME/calmq/consumer-examples`` (default
``~/.cache/...``), keyed by a hash of each example's sources: a re-run does not rebuild.
Measured on 2 cores: warm, about 35 s for the module (the stack's start, the run, then 5-10 s
per example, 5 s of it the idle timeout that ends each); building Java and Go from a warm
~/.m2 and module cache adds about 20 s; an empty ~/.m2 or module cache adds the downloads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from calmq.tooling.devstack import StackState
from tests.support.api import Api
from tests.support.waiting import wait_for
from tests.support.workers import create_tenant_id

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "consumers"
TERMINAL = ("completed", "dead_letter", "cancelled")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "calmq" / "consumer-examples"


def _sources_hash(root: Path, patterns: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for pattern in patterns for p in root.rglob(pattern)):
        if "target" not in path.relative_to(root).parts:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _require(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        message = f"{', '.join(missing)} not on PATH: cannot build this consumer example"
        if _in_ci():
            pytest.fail(f"{message} (CI=true: a missing toolchain fails the run)", pytrace=False)
        pytest.skip(message)


def _build_java() -> list[str]:
    _require("mvn", "java")
    src = EXAMPLES / "java"
    out = _cache_dir() / f"java-{_sources_hash(src, ('pom.xml', '*.java', '*.properties'))}"
    jar = out / "results-consumer.jar"
    if not jar.exists():
        subprocess.run(["mvn", "-q", "-B", "package", f"-DbuildDir={out}"], cwd=src,
                       check=True, timeout=600)
    return ["java", "-jar", str(jar)]


def _build_go() -> list[str]:
    _require("go")
    src = EXAMPLES / "go"
    binary = _cache_dir() / f"go-{_sources_hash(src, ('go.mod', 'go.sum', '*.go'))}"
    if not binary.exists():
        subprocess.run(["go", "build", "-o", str(binary), "."], cwd=src, check=True,
                       timeout=600)
    return [str(binary)]


def _python() -> list[str]:
    return [sys.executable, str(EXAMPLES / "python" / "consume_results.py")]


BUILDERS = {"python": _python, "java": _build_java, "go": _build_go}


def _redeliver(bootstrap: str, job_id: str) -> None:
    """Write the job's result again, byte for byte, to its partition: what a producer retry
    or a relay restart does. A consumer must print it once (the same ``id`` header)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"dup-{uuid.uuid4()}",
                         "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics("calmq.results", timeout=10).topics["calmq.results"]
        consumer.assign([TopicPartition("calmq.results", p, 0) for p in partitions.partitions])
        found: list[Message] = []

        def seen() -> bool:
            found.extend(m for m in consumer.consume(200, timeout=0.2)
                         if m.error() is None and m.key() == job_id.encode())
            return bool(found)

        wait_for(seen, timeout=30, what=f"the result of {job_id} on calmq.results")
    finally:
        consumer.close()
    original = found[0]
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce("calmq.results", original.value(), original.key(),
                     partition=original.partition(), headers=original.headers())
    assert producer.flush(10) == 0


@pytest.fixture(scope="module")
def run(stack: StackState) -> dict:
    """A mixed run of one tenant, every job terminal, and what the API says of each."""
    tenant_id, key = create_tenant_id(stack.env["CALMQ_DATABASE_URL"],
                                      f"consumers-{uuid.uuid4().hex[:8]}")
    api = Api(stack.env["CALMQ_API_URL"], key)
    submitted = {
        api.submit({"text": "A result for every consumer.", "mode": "success"},
                   metadata={"order_id": "A-1", "lines": [1, 2]}): "completed",
        api.submit({"text": "No metadata on this one.", "mode": "success"}): "completed",
        api.submit({"text": "please be malformed", "mode": "malformed"},
                   metadata={"order_id": "A-2"}): "dead_letter",
    }
    reviewed = api.submit({"text": "unsure", "mode": "low_confidence"},
                          metadata={"order_id": "A-3"})
    submitted[reviewed] = "completed"
    wait_for(lambda: api.job(reviewed)["status"] == "awaiting_review", timeout=60,
             what="the low-confidence job to await review")
    status, _h, body = api.call("POST", f"/v1/jobs/{reviewed}/review",
                                {"decision": "approve", "reviewer": "consumers@example.com"})
    assert status == 200, body
    jobs = {}
    for job_id in submitted:
        jobs[job_id] = wait_for(
            lambda j=job_id: (job := api.job(j))["status"] in TERMINAL and job,
            timeout=90, what=f"job {job_id} to finish")
    assert {j: job["status"] for j, job in jobs.items()} == submitted
    assert any(e["type"] == "reviewed" for e in jobs[reviewed]["events"])
    _redeliver(stack.env["CALMQ_KAFKA_BOOTSTRAP"], next(iter(jobs)))
    # One more than the run's jobs: a consumer that de-duplicates reads to the end of the
    # topic and exits idle; one that prints the duplicate stops at the limit and fails below.
    env = {**os.environ, **stack.env, "CALMQ_API_KEY": key, "CALMQ_TENANT_ID": str(tenant_id),
           "CALMQ_MAX_MESSAGES": str(len(jobs) + 1), "CALMQ_IDLE_TIMEOUT": "5"}
    return {"jobs": jobs, "env": env}


@pytest.mark.timeout(900)  # a cold first run downloads the Maven and Go dependencies
@pytest.mark.parametrize("language", list(BUILDERS))
def test_example_agrees_with_the_api_on_every_job(run: dict, language: str) -> None:
    """The example prints one line per job of the run, as the API reports the job."""
    command = BUILDERS[language]()
    env = {**run["env"], "CALMQ_CONSUMER_GROUP": f"examples-{language}-{uuid.uuid4()}"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    by_job = {line["job_id"]: line for line in lines}
    assert len(lines) == len(by_job), "a job printed twice: de-duplication failed"
    assert set(by_job) == set(run["jobs"]), done.stderr[-4000:]
    for job_id, job in run["jobs"].items():
        line = by_job[job_id]
        assert line["status"] == job["status"], line
        assert line["error_code"] == (job["error"]["code"] if job["error"] else None), line
        assert line["artifact_sha256"] == (job["artifact"]["sha256"] if job["artifact"]
                                           else None), line
        # The API shows a job submitted without metadata with {}, the event with null.
        assert line["metadata"] == (job["metadata"] or None), line
        uuid.UUID(line["event_id"])
        # v2: the job's usage over all attempts and the workflow's version.
        usage = job["usage"]
        assert line["usage"]["input_tokens"] == usage["input_tokens"], line
        assert line["usage"]["output_tokens"] == usage["output_tokens"], line
        assert line["usage"]["cost_usd"] == pytest.approx(usage["cost_usd"]), line
        assert isinstance(line["workflow_version"], int), line
