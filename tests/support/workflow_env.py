"""Processes of the workflow and review tests: a ledger, an API and workers that load the
test workflows (tests/support/workflows.py), on the test pools only."""

from __future__ import annotations

import json
import subprocess
import tempfile
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from calmq.tooling.devstack import StackState, processes
from tests.support.api import Api
from tests.support.ledger import Ledger
from tests.support.waiting import wait_for
from tests.support.workers import Procs, create_pool_topics, create_tenant_id
from tests.support.workflows import LEDGER_POOL, POOL, POOLS

TERMINAL = ("completed", "dead_letter", "cancelled")


class WorkflowEnv:
    def __init__(self, stack: StackState, *, workers: bool = True) -> None:
        self.stack = stack
        self.db = stack.env["CALMQ_DATABASE_URL"]
        self.ledger = Ledger().start()
        for pool in POOLS:
            create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], pool, ["5s"])
        self.settings = {"workflow_modules": "tests.support.workflows",
                         "ledger_url": self.ledger.url, "lease_seconds": "2",
                         "grace_seconds": "1", "retry_tiers": "5s"}
        self.procs = Procs(stack.env, Path(tempfile.mkdtemp(prefix="calmq-wf-logs-")))
        port = processes.free_port()
        self.api_proc = self.procs.start("api", "api", api_port=str(port), **self.settings)
        wait_for(lambda: self.api_proc.poll() is not None or processes.port_open("127.0.0.1", port),
                 timeout=30, what="the workflow test API")
        assert self.api_proc.poll() is None, "the workflow test API exited"
        self.api_url = f"http://127.0.0.1:{port}"
        self.tenant_name = f"wf-{uuid.uuid4().hex[:8]}"
        self.tenant, key = create_tenant_id(self.db, self.tenant_name)
        # What the API records as the caller in audit fields (a review's reviewer, ...).
        self.identity = f"tenant {self.tenant_name} key {key[:12]}"
        self.api = Api(self.api_url, key)
        if workers:  # False: the test starts them (start_workers), e.g. to see jobs wait
            self.start_workers()

    def start_workers(self) -> None:
        self.worker, self.worker_port = self.start_worker(POOL)
        self.ledger_worker, self.ledger_worker_port = self.start_worker(LEDGER_POOL)

    def start_worker(self, pool: str, **extra: str) -> tuple[subprocess.Popen[bytes], int]:
        return self.procs.worker(pool, **{**self.settings, **extra})

    def submit(self, workflow: str, input_: dict[str, Any]) -> str:
        status, _h, body = self.api.call("POST", "/v1/jobs",
                                         {"workflow": workflow, "input": input_})
        assert status == 202, body
        return str(body["job_id"])

    def job(self, job_id: str) -> dict[str, Any]:
        return self.api.job(job_id)

    def wait_status(self, job_id: str, *statuses: str, timeout: float = 60) -> dict[str, Any]:
        return wait_for(lambda: (j := self.job(job_id))["status"] in statuses and j,
                        timeout=timeout, what=f"job {job_id} to reach {statuses}")

    def provider_calls(self, job_id: str) -> int:
        url = self.stack.env["CALMQ_FAKE_PROVIDER_URL"] + "/stats"
        with urllib.request.urlopen(url, timeout=5) as resp:
            stats = json.loads(resp.read())
        return int(stats["by_job"].get(job_id, {}).get("calls", 0))

    def sql(self, query: str, *params: Any) -> list[dict[str, Any]]:
        with psycopg.connect(self.db, row_factory=dict_row, autocommit=True) as conn:
            return conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def attempts(self, job_id: str) -> dict[str, int]:
        rows = self.sql("SELECT step, count(*)::int AS n FROM job_attempts WHERE job_id = %s "
                        "GROUP BY step", job_id)
        return {r["step"]: r["n"] for r in rows}

    def close(self) -> None:
        self.procs.stop_all()
        self.ledger.stop()
