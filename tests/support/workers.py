"""Processes and jobs of the processing-engine tests: workers and forwarders of a test pool.

The stack's own worker consumes the ``default`` pool; these tests start their own
``calmq worker --pool <test pool>`` (and ``calmq forwarder``) processes with settings of
their own (short lease, small retry tiers, a step timeout) and submit jobs straight to that
pool with ``calmq.data.insert_job`` -- the job row, its history and its outbox row in one
transaction, exactly as the API writes them, but with the pool chosen by the test (the HTTP
contract has no pool field: a workflow's pool decides it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from calmq import topics
from calmq.data import NewJob, Store, insert_job
from calmq.kafka import create_topics
from calmq.tooling.devstack import StackState, processes
from tests.support.api import Api
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]

TIERS = "1s,2s,4s"
TERMINAL = ("completed", "dead_letter", "cancelled")
# Short lease so a killed worker's job is requeued quickly; small tiers so retries are quick.
BASE = {"retry_tiers": TIERS, "retry_initial_seconds": "0.5", "lease_seconds": "2",
        "grace_seconds": "2"}


def _pool(name: str) -> str:
    return f"t4{name}{uuid.uuid4().hex[:6]}"


class Env:
    """A test module's view of the stack: its tenant, its processes, its pools."""

    def __init__(self, stack: StackState, procs: Procs) -> None:
        self.stack = stack
        self.procs = procs
        self.db = stack.env["CALMQ_DATABASE_URL"]
        self.bootstrap = stack.env["CALMQ_KAFKA_BOOTSTRAP"]
        self.tenant, key = create_tenant_id(self.db, f"proc-{uuid.uuid4().hex[:8]}")
        self.api = Api(stack.env["CALMQ_API_URL"], key)

    def pool(self, name: str) -> str:
        pool = _pool(name)
        create_pool_topics(self.bootstrap, pool, TIERS.split(","))
        return pool

    def submit(self, pool: str, *inputs: dict[str, Any], **kw: Any) -> list[str]:
        return submit(self.db, self.tenant, pool, list(inputs), **kw)

    def finished(self, job_id: str, timeout: float = 60) -> dict[str, Any]:
        return wait_for(lambda: (j := self.api.job(job_id))["status"] in TERMINAL and j,
                        timeout=timeout, what=f"job {job_id} to finish")


class Procs:
    """Child processes started by one test module; ``stop_all`` ends exactly those."""

    def __init__(self, env: Mapping[str, str], log_dir: Path) -> None:
        self.env = dict(env)
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str, **settings: str) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
        env.update(self.env)
        env.update({"CALMQ_" + k.upper(): v for k, v in settings.items()})
        env["PYTHONUNBUFFERED"] = "1"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}-{len(self.started)}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "calmq.cli", *args], env=env, cwd=ROOT, stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.started.append(proc)
        return proc

    def worker(self, pool: str, *, metrics_port: int | None = None,
               **settings: str) -> tuple[subprocess.Popen[bytes], int]:
        port = metrics_port or processes.free_port()
        proc = self.start("worker", "worker", "--pool", pool, "--metrics-port", str(port),
                          **settings)
        wait_for(lambda: proc.poll() is not None or metric(port, "calmq_worker_in_flight")
                 is not None, timeout=30, what="the worker's metrics endpoint")
        assert proc.poll() is None, f"worker exited with {proc.returncode}"
        return proc, port

    def api(self, **settings: str) -> str:
        """An API of this module's own (its workflow modules, its provider) on a free port;
        returns its URL once it listens."""
        port = processes.free_port()
        proc = self.start("api", "api", api_port=str(port), **settings)
        wait_for(lambda: proc.poll() is not None or processes.port_open("127.0.0.1", port),
                 timeout=30, what="the test's API")
        assert proc.poll() is None, f"the test's API exited with {proc.returncode}"
        return f"http://127.0.0.1:{port}"

    def forwarder(self, **settings: str) -> subprocess.Popen[bytes]:
        port = processes.free_port()
        proc = self.start("forwarder", "forwarder", "--metrics-port", str(port), **settings)
        wait_for(lambda: proc.poll() is not None or
                 metric(port, "calmq_forwarder_republished_total") is not None,
                 timeout=30, what="the forwarder's metrics endpoint")
        assert proc.poll() is None, f"forwarder exited with {proc.returncode}"
        return proc

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def forwarded_env(stack: StackState, logs: Path) -> Iterator[Env]:
    """Test pools with a forwarder for the quick retry tiers; stops every process after."""
    procs = Procs(stack.env, logs)
    create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], "unused", TIERS.split(","))
    procs.forwarder(retry_tiers=TIERS)
    try:
        yield Env(stack, procs)
    finally:
        procs.stop_all()


def metric(port: int, name: str) -> float | None:
    """The value of an unlabelled sample (or the sum over labels) on a /metrics page."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")
              and line[len(name):len(name) + 1] in (" ", "{")]
    return sum(values) if values else None


def start_fake_provider(log_dir: Path, *args: str) -> tuple[int, str]:
    """A fake provider of this test's own (``args``: its options, e.g. a latency), on a free
    port; returns its pid (for processes.stop) and its URL once it answers."""
    port = processes.free_port()
    pid = processes.start([sys.executable, "-m", "calmq.cli", "fake-provider", "--port",
                           str(port), *args], log_dir / "fake-provider.log")
    wait_for(lambda: processes.port_open("127.0.0.1", port), timeout=30,
             what="the test's fake provider")
    return pid, f"http://127.0.0.1:{port}"


def create_pool_topics(bootstrap: str, pool: str, tiers: list[str], partitions: int = 2) -> None:
    names = [topics.topic_for_route(topics.work_route(pool, p)) for p in ("interactive", "bulk")]
    names += [topics.topic_for_route(topics.retry_route(t)) for t in tiers]
    create_topics(bootstrap, names, partitions=partitions)


def create_tenant_id(database_url: str, name: str) -> tuple[uuid.UUID, str]:
    async def create() -> tuple[uuid.UUID, str]:
        store = Store(database_url, max_size=1)
        await store.open()
        try:
            tenant, key = await store.tenants.create(name)
            return tenant.id, key
        finally:
            await store.close()

    return asyncio.run(create())


def submit(database_url: str, tenant_id: uuid.UUID, pool: str, inputs: list[dict[str, Any]],
           *, priority: str = "interactive", workflow: str = "summarize",
           max_attempts: int = 3, deadline_at: datetime | None = None) -> list[str]:
    """Submit jobs to ``pool`` as the API would (job row + history + outbox, one transaction)."""

    async def run() -> list[str]:
        store = Store(database_url, max_size=4)
        await store.open()
        try:
            async def one(data: dict[str, Any]) -> str:
                job = NewJob(
                    id=uuid.uuid4(), tenant_id=tenant_id, workflow=workflow, workflow_version=1,
                    priority=priority, pool=pool, step=workflow, max_attempts=max_attempts,
                    input=data, input_ref=None, metadata={}, callback_url=None,
                    deadline_at=deadline_at, trace_parent=None,
                )
                async with store.pool.connection() as conn:
                    await insert_job(conn, job)
                return str(job.id)

            out: list[str] = []
            for i in range(0, len(inputs), 200):
                out += await asyncio.gather(*(one(d) for d in inputs[i:i + 200]))
            return out
        finally:
            await store.close()

    return asyncio.run(run())


def all_completed(conn: psycopg.Connection[Any], ids: list[str]) -> bool:
    """Whether every job of ``ids`` is completed (a wait_for condition)."""
    row = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s::uuid[])"
                       " AND status = 'completed'", (ids,)).fetchone()
    return bool(row and row[0] == len(ids))


def job_rows(database_url: str, ids: list[str]) -> dict[str, dict[str, Any]]:
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        rows = conn.execute(
            "SELECT id::text AS id, status, attempt, errors, error, artifact FROM jobs "
            "WHERE id = ANY(%s::uuid[])", (ids,)).fetchall()
    return {r["id"]: r for r in rows}


def history(database_url: str, job_id: str) -> list[dict[str, Any]]:
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT type, at, attempt, detail FROM job_events WHERE job_id = %s ORDER BY id",
            (job_id,)).fetchall()


def fake_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/stats", timeout=10) as resp:
        result: dict[str, Any] = json.loads(resp.read())
        return result
