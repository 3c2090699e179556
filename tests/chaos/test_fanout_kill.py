"""kill -9 of a worker, twice, while a parent's 600 child jobs run (issue 43): every child
completes once, none is lost, and the join fires exactly once.

Two worker processes share the fan-out pool (tests/support/fanout_workflows.py); each
child (3 attempts: a lease lost to a kill is requeued, not a dead letter) takes 200 ms, so
the killed worker holds children in flight. The join is
decided in the transaction that settles a child, so a kill cannot make it fire twice or not
at all: the parent's history has one ``children_joined``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import uuid
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest

from calmq.tooling.devstack import StackState
from tests.support.api import Api
from tests.support.fanout_workflows import NAME, POOL, RETRIED
from tests.support.waiting import wait_for
from tests.support.workers import BASE, TIERS, Procs, create_pool_topics, create_tenant_id

pytestmark = pytest.mark.chaos

CHILDREN = 600


# Two kills each wait out the dead member's session before its partitions move on.
@pytest.mark.timeout(900)
def test_two_worker_kills_lose_no_child_and_join_once(stack: StackState) -> None:
    """600 children, two workers, one killed with -9 twice: each child completes once, one join."""
    procs = Procs(stack.env, Path(tempfile.mkdtemp(prefix="calmq-fanout-chaos-")))
    db = stack.env["CALMQ_DATABASE_URL"]
    try:
        create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], POOL, TIERS.split(","),
                           partitions=4)
        settings: dict[str, Any] = {**BASE, "workflow_modules": "tests.support.fanout_workflows",
                    "provider_url": stack.env["CALMQ_FAKE_PROVIDER_URL"],
                    "concurrency": "32"}
        api = Api(procs.api(**settings), create_tenant_id(db, f"chaos-{uuid.uuid4().hex[:6]}")[1])
        status, _h, body = api.call("POST", "/v1/jobs", {"workflow": NAME, "input": {
            "texts": [f"chaos child {i}" for i in range(CHILDREN)],
            "delays": [200] * CHILDREN, "child": RETRIED}})
        assert status == 202, body
        parent = str(body["job_id"])
        workers = [procs.worker(POOL, **settings)[0] for _ in range(2)]

        def completed() -> int:
            with psycopg.connect(db) as conn:
                row = conn.execute("SELECT count(*) FROM jobs WHERE parent_id = %s"
                                   " AND status = 'completed'", (parent,)).fetchone()
            return int(row[0]) if row else 0

        def at_least(threshold: int) -> bool:
            return completed() >= threshold

        def busy(among: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes] | None:
            return next((w for w in among if running_on(w.pid)), None)

        def running_on(pid: int) -> int:
            with psycopg.connect(db) as conn:
                row = conn.execute("SELECT count(*) FROM jobs WHERE parent_id = %s AND"
                                   " status = 'running' AND lease_owner = %s",
                                   (parent, f"{socket.gethostname()}-{pid}")).fetchone()
            return int(row[0]) if row else 0

        for kill, threshold in enumerate((CHILDREN // 5, CHILDREN // 2), start=1):
            wait_for(partial(at_least, threshold), timeout=180,
                     what=f"{threshold} children completed before kill {kill}")
            # The victim: a worker holding children's leases (the other may hold them all).
            victim = wait_for(partial(busy, list(workers)), timeout=60,
                              what=f"a worker running children before kill {kill}")
            assert completed() < CHILDREN, "the run ended before the kill: nothing was tested"
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(timeout=10)
            workers = [w for w in workers if w is not victim]
            workers.append(procs.worker(POOL, **settings)[0])
        job = wait_for(lambda: (j := api.job(parent))["status"] in (
            "completed", "dead_letter", "cancelled") and j, timeout=600,
            what="the parent to finish")
        assert job["status"] == "completed", job
        with psycopg.connect(db) as conn:
            events = conn.execute(
                "SELECT e.job_id::text, e.type FROM job_events e JOIN jobs j ON j.id = e.job_id"
                " WHERE j.parent_id = %s", (parent,)).fetchall()
            joins = conn.execute("SELECT count(*) FROM job_events WHERE job_id = %s AND"
                                 " type = 'children_joined'", (parent,)).fetchone()
        done = Counter(job_id for job_id, kind in events if kind == "completed")
        assert len(done) == CHILDREN  # no child lost
        assert max(done.values()) == 1  # none completed twice
        assert joins is not None
        assert joins[0] == 1  # the join fired once
        assert any(kind == "requeued_after_restart" for _j, kind in events), \
            "no child was in flight at a kill"
    finally:
        procs.stop_all()
