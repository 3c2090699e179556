"""The downstream consumer examples (examples/consumers/{python,java,go,node}) against the
real stack.

A mixed run goes through the API (completed, dead-lettered, reviewed then approved); each
example is built (Maven, the Go toolchain), run as a subprocess with its own consumer group
from the oldest result, and must agree with the API on every job of the run, printing a
redelivered result once. The examples print the tenant's results only (``CALMQ_TENANT_ID``),
so other tests' results do not count.

Each reads a properties file (``CALMQ_CONSUMER_CONFIG``) as it would a secured cluster's; the
Python one reads from the secured stack too, and the Node one reads 40 of 40 results.

Builds are cached under ``$XDG_CACHE_HOME/calmq/consumer-examples`` (default
``~/.cache/...``), keyed by a hash of each example's sources: a re-run does not rebuild. The
Node example's packages are installed by ``npm ci`` from its lock file (``make examples``),
again only when the lock changed.
Measured on 2 cores: warm, about 35 s for the module (the stack's start, the run, then 5-10 s
per example, 5 s of it the idle timeout that ends each); building Java and Go from a warm
~/.m2 and module cache adds about 20 s; an empty ~/.m2 or module cache adds the downloads.
"""

from __future__ import annotations

import fcntl
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


def _build_node() -> list[str]:
    """``npm ci`` of the example's pinned packages when its lock changed (as `make
    examples` does), under a file lock: test sessions may run at once in one checkout."""
    _require("node", "npm")
    src = EXAMPLES / "node"
    installed, lock = src / "node_modules" / ".package-lock.json", src / "package-lock.json"
    with open(src / ".install.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
            subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=src, check=True,
                           timeout=600, capture_output=True)
    return ["node", str(src / "consume_results.mjs")]


BUILDERS = {"python": _python, "java": _build_java, "go": _build_go, "node": _build_node}


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
def test_example_agrees_with_the_api_on_every_job(run: dict, language: str,
                                                  tmp_path: Path) -> None:
    """The example, given a properties file, prints one line per job of the run, as the
    API reports the job."""
    command = BUILDERS[language]()
    config = tmp_path / "client.properties"
    config.write_text("# what a secured cluster's file holds, for this plaintext one\n"
                      "security.protocol=PLAINTEXT\n")
    env = {**run["env"], "CALMQ_CONSUMER_GROUP": f"examples-{language}-{uuid.uuid4()}",
           "CALMQ_CONSUMER_CONFIG": str(config)}
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


def _lines(done: subprocess.CompletedProcess[str]) -> list[dict]:
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


@pytest.mark.timeout(600)
def test_the_node_example_reads_40_of_40_results(stack: StackState) -> None:
    """The Node.js example reads the 40 results of a tenant's 40 jobs, each once."""
    command = _build_node()
    tenant_id, key = create_tenant_id(stack.env["CALMQ_DATABASE_URL"],
                                      f"node-{uuid.uuid4().hex[:8]}")
    api = Api(stack.env["CALMQ_API_URL"], key)
    jobs = [api.submit({"text": f"result {n} of 40", "mode": "success"}) for n in range(40)]
    for job_id in jobs:
        wait_for(lambda j=job_id: api.job(j)["status"] in TERMINAL, timeout=120,
                 what=f"job {job_id} to finish")
    env = {**os.environ, **stack.env, "CALMQ_API_KEY": key, "CALMQ_TENANT_ID": str(tenant_id),
           "CALMQ_MAX_MESSAGES": "40", "CALMQ_IDLE_TIMEOUT": "20",
           "CALMQ_CONSUMER_GROUP": f"examples-node-40-{uuid.uuid4()}"}
    lines = _lines(subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=300, check=False))
    assert sorted(line["job_id"] for line in lines) == sorted(jobs)
    assert {line["status"] for line in lines} == {"completed"}
    assert all(line["artifact_sha256"] for line in lines)


@pytest.mark.timeout(600)
def test_the_python_example_reads_from_the_secured_stack(secured_stack: StackState,
                                                         tmp_path: Path) -> None:
    """Given a properties file with SASL_SSL (SCRAM-SHA-512), the CA and the registry's
    basic auth, the Python example reads a tenant's results from the secured stack."""
    state = secured_stack
    tenant_id, key = create_tenant_id(state.env["CALMQ_DATABASE_URL"],
                                      f"secured-ex-{uuid.uuid4().hex[:6]}")
    api = Api(state.env["CALMQ_API_URL"], key)
    jobs = [api.submit({"text": f"secured {n}", "mode": "success"}) for n in range(3)]
    for job_id in jobs:
        wait_for(lambda j=job_id: api.job(j)["status"] == "completed", timeout=120,
                 what=f"job {job_id} to complete")
    config = tmp_path / "secured.properties"
    kafka_password = Path(state.env["CALMQ_KAFKA_SASL_PASSWORD_FILE"]).read_text().strip()
    registry_password = Path(
        state.env["CALMQ_SCHEMA_REGISTRY_PASSWORD_FILE"]).read_text().strip()
    config.write_text(
        f"security.protocol={state.env['CALMQ_KAFKA_SECURITY_PROTOCOL']}\n"
        f"sasl.mechanism={state.env['CALMQ_KAFKA_SASL_MECHANISM']}\n"
        f"sasl.username={state.env['CALMQ_KAFKA_SASL_USERNAME']}\n"
        f"sasl.password={kafka_password}\n"
        f"ssl.ca.location={state.env['CALMQ_KAFKA_SSL_CA_LOCATION']}\n"
        "schema.registry.basic.auth.user.info="
        f"{state.env['CALMQ_SCHEMA_REGISTRY_USERNAME']}:{registry_password}\n"
        f"schema.registry.ssl.ca.location={state.env['CALMQ_SCHEMA_REGISTRY_CA_LOCATION']}\n")
    config.chmod(0o600)
    base = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    env = {**base, "CALMQ_KAFKA_BOOTSTRAP": state.env["CALMQ_KAFKA_BOOTSTRAP"],
           "CALMQ_SCHEMA_REGISTRY_URL": state.env["CALMQ_SCHEMA_REGISTRY_URL"],
           "CALMQ_API_URL": state.env["CALMQ_API_URL"], "CALMQ_API_KEY": key,
           "CALMQ_CONSUMER_CONFIG": str(config), "CALMQ_IDLE_TIMEOUT": "10",
           "CALMQ_TENANT_ID": str(tenant_id), "CALMQ_MAX_MESSAGES": str(len(jobs)),
           "CALMQ_CONSUMER_GROUP": f"examples-secured-{uuid.uuid4()}"}
    lines = _lines(subprocess.run(_python(), env=env, capture_output=True, text=True,
                                  timeout=300, check=False))
    assert sorted(line["job_id"] for line in lines) == sorted(jobs)
    assert {line["status"] for line in lines} == {"completed"}
