"""A schema registry that is away is not the message's fault.

A worker of a pool of its own reads the registry through a TCP fault proxy, cut before the
worker ever saw a schema: the job's message cannot be decoded yet. The worker must wait the
outage out (retrying, keeping its loop, heartbeats and commits running) instead of sending
the message to calmq.dlq as poison and acknowledging it, which left the job queued for good.
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from calmq.tooling.devstack import StackState
from tests.support.faultproxy import FaultProxy
from tests.support.waiting import wait_for
from tests.support.workers import BASE, Env, forwarded_env, metric

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from forwarded_env(stack, tmp_path_factory.mktemp("registry-outage-logs"))


def test_job_waits_out_a_registry_outage_and_completes(env: Env, stack: StackState) -> None:
    registry = urlparse(stack.env["CALMQ_SCHEMA_REGISTRY_URL"])
    with FaultProxy(registry.hostname or "127.0.0.1", registry.port or 80) as proxy:
        proxied = registry._replace(netloc=f"127.0.0.1:{proxy.port}").geturl()
        proxy.cut()
        pool = env.pool("registry")
        _proc, port = env.procs.worker(pool, schema_registry_url=proxied, **BASE)
        [job_id] = env.submit(pool, {"text": "decoded once the registry is back",
                                     "mode": "success"})
        wait_for(lambda: (metric(port, "calmq_operation_retries_total") or 0) >= 2,
                 timeout=60, what="the worker to retry the registry")
        assert (metric(port, "calmq_poison_messages_total") or 0) == 0
        assert env.api.job(job_id)["status"] == "queued"
        proxy.restore()
        job = env.finished(job_id)
    assert job["status"] == "completed"
    assert (metric(port, "calmq_poison_messages_total") or 0) == 0
