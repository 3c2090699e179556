"""Three worker processes share one token budget against a rate-limited provider.

The issue's scenario exactly: 300 bulk jobs and then 20 interactive ones on a fleet whose
provider allows ~120 jobs a minute (~2.7 minutes of work; ~180 s here, 0 of 320 calls
answered 429). SCALE multiplies every rate for a quicker run by hand; keep it at most 2: the
provider counts a sliding minute, and a run shorter than a minute never fills its window, so
it could not show whether the fleet stays under it.

The wait target sits close to what the quota allows. The fleet's rate is 97.5 % of the
provider's (the sliding-minute margin), ~1.95 jobs a second, so even when interactive work
takes the whole rate the k-th of 20 interactive jobs finishes no sooner than ~(k - 1) x 0.513 s
after the first: the 19th at ~9.2 s, the 20th at ~9.7 s, plus the first one's own trip
(~0.3 s). "p95 <= 10 s" is therefore read as the issue says it, 95 % of the interactive jobs
(19 of 20) within the setting; an estimator that interpolates towards the 20th (e.g.
statistics.quantiles' default, ~10.0 s here) would make the test a coin flip on the machine's
noise. What the budget does to get there is asserted on its own: while interactive jobs wait,
bulk jobs do not take the quota from them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from calmq.producers.client import enqueue
from calmq.settings import Settings
from calmq.tooling.devstack import StackState, processes
from calmq.workflows.summarize import SUMMARIZE
from tests.support.api import Api, create_tenant
from tests.support.waiting import wait_for

SCALE = 1
BULK, INTERACTIVE, WORKERS = 300, 20, 3
POOL = "budgetfleet"
# One summarize call of these inputs costs the provider ~45 prompt tokens + 256 max_tokens.
TOKENS_PER_JOB = 301
TOKENS_PER_MINUTE = 120 * SCALE * TOKENS_PER_JOB
WORKFLOWS = {"summarize": dataclasses.replace(SUMMARIZE, pool=POOL)}


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@dataclasses.dataclass(frozen=True)
class Fleet:
    provider_url: str
    metrics_url: str  # of the first worker


@pytest.fixture
def fleet(stack: StackState, tmp_path: Path) -> Iterator[Fleet]:
    """A fake provider limited to ~120 jobs/min (x SCALE) and three workers sharing it."""
    env = dict(stack.env)
    pids: list[int] = []
    try:
        port = processes.free_port()
        url = f"http://127.0.0.1:{port}"
        pids.append(processes.start(
            [sys.executable, "-m", "calmq.cli", "fake-provider", "--port", str(port),
             "--tokens-per-minute", str(TOKENS_PER_MINUTE)],
            tmp_path / "fake-provider.log"))
        wait_for(lambda: processes.port_open("127.0.0.1", port), timeout=30,
                 what="the rate-limited fake provider")
        worker_env = {**_base_env(), **env, "CALMQ_POOL": POOL, "CALMQ_PROVIDER_URL": url,
                      "CALMQ_BUDGET_TOKENS_PER_MINUTE": str(TOKENS_PER_MINUTE)}
        create = processes.start([sys.executable, "-m", "calmq.cli", "topics", "create"],
                                 tmp_path / "topics.log", env=worker_env)
        wait_for(lambda: not processes.is_alive(create), timeout=60, what="topics create")
        metrics_port = processes.free_port()
        for i in range(WORKERS):
            argv = [sys.executable, "-m", "calmq.cli", "worker"]
            if i == 0:
                argv += ["--metrics-port", str(metrics_port)]
            pids.append(processes.start(
                argv, tmp_path / f"worker{i}.log",
                env={**worker_env, "CALMQ_WORKER_ID": f"budget-fleet-{i}"}))
        yield Fleet(url, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        for pid in reversed(pids):
            processes.stop(pid)


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}


def _count(conn: psycopg.Connection[Any], tenant: uuid.UUID, status: str) -> int:
    row = conn.execute("SELECT count(*) FROM jobs WHERE tenant_id = %s AND status = %s",
                       (tenant, status)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.timeout(600)  # ~3 minutes of provider quota by design
def test_fleet_finishes_everything_with_few_429s_and_prompt_interactive(
    stack: StackState, fleet: Fleet,
) -> None:
    """300 bulk + 20 interactive jobs complete; <= 1 % of calls see 429; interactive p95 holds."""
    settings = Settings.load(environ={})
    database_url = stack.env["CALMQ_DATABASE_URL"]
    key = create_tenant(database_url, f"budget-fleet-{uuid.uuid4().hex[:8]}")
    api = Api(stack.env["CALMQ_API_URL"], key)
    with psycopg.connect(database_url, autocommit=True) as conn:
        tenant = conn.execute("SELECT tenant_id FROM api_keys WHERE key_prefix = %s",
                              (key[:12],)).fetchone()[0]  # type: ignore[index]
        with conn.transaction():
            for i in range(BULK):
                enqueue(conn, tenant_id=tenant, workflow="summarize", priority="bulk",
                        input={"text": f"bulk job number {i:04d} of the budget test"},
                        workflows=WORKFLOWS)
        # Interactive work arrives while the bulk run is well under way.
        wait_for(lambda: _count(conn, tenant, "completed") >= BULK // 3, timeout=120,
                 what="a third of the bulk jobs")
        interactive = [
            enqueue(conn, tenant_id=tenant, workflow="summarize", priority="interactive",
                    input={"text": f"interactive job number {i:04d} of the test"},
                    workflows=WORKFLOWS)
            for i in range(INTERACTIVE)
        ]
        wait_for(lambda: _count(conn, tenant, "completed") == BULK + INTERACTIVE, timeout=300,
                 what="every job completed")
        assert _count(conn, tenant, "dead_letter") == 0
        # Queue wait, measured strictly: from submission to completion (it includes the
        # model call, which the fake answers at once).
        waits = [float(r[0]) for r in conn.execute(
            "SELECT extract(epoch FROM e.at - j.created_at) FROM jobs j"
            " JOIN job_events e ON e.job_id = j.id AND e.type = 'completed'"
            " WHERE j.id = ANY(%s)", (interactive,))]
        # While interactive jobs wait, bulk does not take the quota from them: between the first
        # and the last interactive completion only bulk calls admitted before the interactive
        # jobs arrived may finish (a slice per worker). Held to the interactive share alone
        # (20 %), ~75 bulk jobs would finish in that window.
        bulk_between = conn.execute(
            "WITH i AS (SELECT min(e.at) AS first, max(e.at) AS last FROM job_events e"
            "           WHERE e.job_id = ANY(%s) AND e.type = 'completed')"
            " SELECT count(*) FROM jobs j JOIN job_events e ON e.job_id = j.id, i"
            " WHERE j.tenant_id = %s AND j.priority = 'bulk' AND e.type = 'completed'"
            "   AND e.at > i.first AND e.at < i.last",
            (interactive, tenant)).fetchone()[0]  # type: ignore[index]
    assert len(waits) == INTERACTIVE
    # p95 as the issue means it: 95 % of the interactive jobs waited no longer than the setting.
    p95 = sorted(waits)[math.ceil(0.95 * len(waits)) - 1]
    assert p95 <= settings.interactive_wait_seconds, sorted(waits)
    assert bulk_between <= WORKERS * 2, (bulk_between, sorted(waits))

    stats = _get_json(fleet.provider_url + "/stats")
    calls = stats["calls"]
    rejected = stats["status_counts"].get("429", 0)
    assert calls >= BULK + INTERACTIVE
    assert rejected <= 0.01 * calls, stats["status_counts"]

    view = api.job(str(interactive[0]))
    assert view["usage"]["input_tokens"] > 0
    assert view["usage"]["output_tokens"] > 0
    assert view["usage"]["cost_usd"] > 0

    # Tokens and cost by workflow, tenant and provider, on the worker's /metrics.
    with urllib.request.urlopen(fleet.metrics_url, timeout=5) as resp:
        families = list(text_string_to_metric_families(resp.read().decode()))
    ours = {"workflow": "summarize", "tenant": str(tenant), "provider": "openai"}
    for name in ("calmq_model_tokens_total", "calmq_model_cost_usd_total"):
        values = [sample.value for family in families for sample in family.samples
                  if sample.name == name and ours.items() <= sample.labels.items()]
        assert values, f"{name} with {ours} is not among the worker's metrics"
        assert sum(values) > 0
