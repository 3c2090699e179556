"""Prompt caching and the cost per job on the real stack (issue 46 items 3 and 4): a workflow
whose two steps share a 4,000-token prompt prefix, marked for the cache, run by two workers
against the fake provider with retries (a flaky first call), a fallback (429s move the
calls to the step's second model) and reviews (approved in the API). At the fake, at least
90 % of the eligible input tokens (the marked prefix of every answered call) are billed as
cached; each job's recorded cost equals the fake's bill of its calls within 1 %, at the same
prices; the cache's tokens and savings and the cost per accepted job show in the workers'
and the API's metrics and in `calmq costs`.

Run for OpenAI's Chat Completions (prompt_cache_key) and Anthropic's Messages
(cache_control, cache writes priced at the write price)."""

from __future__ import annotations

import json
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from calmq.calls.pricing import ModelPrice, cost_usd
from calmq.tooling.devstack import StackState, processes
from tests.support.api import Api
from tests.support.cache_workflows import CACHE_POOL, FIRST, PREFIX_TOKENS, SECOND
from tests.support.cli import calmq, calmq_env
from tests.support.waiting import wait_for
from tests.support.workers import (
    Procs,
    all_completed,
    create_pool_topics,
    create_tenant_id,
    fake_stats,
    metric,
    start_fake_provider,
)

pytestmark = pytest.mark.integration

# The prices both sides bill at: CALMQ_PRICES for the workers, the same table for the
# fake's usage. Cached input at a tenth, a cache write at 1.25 times the input price (as
# Anthropic bills them).
PRICES = {FIRST: ModelPrice(input=3.0, output=15.0, cached_input=0.3, cache_write_input=3.75),
          SECOND: ModelPrice(input=1.0, output=5.0, cached_input=0.1, cache_write_input=1.25)}


@dataclass
class Rig:
    kind: str
    api: Api
    db: str
    provider: str
    ports: list[int]
    tenant: str
    stack: StackState


@pytest.fixture(scope="module", params=["openai", "anthropic"])
def rig(stack: StackState, request: pytest.FixtureRequest) -> Iterator[Rig]:
    kind = str(request.param)
    log_dir = Path(tempfile.mkdtemp(prefix=f"calmq-cache-{kind}-logs-"))
    procs = Procs(stack.env, log_dir)
    pid, url = start_fake_provider(log_dir, "--latency-ms", "20")
    try:
        create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], CACHE_POOL, ["1s"],
                           partitions=4)
        settings = {"workflow_modules": "tests.support.cache_workflows", "provider": kind,
                    "provider_url": url, "retry_tiers": "1s", "model": FIRST,
                    "prices": json.dumps({m: p.model_dump() for m, p in PRICES.items()})}
        api = procs.api(**settings)
        procs.forwarder(retry_tiers="1s")
        ports = [procs.worker(CACHE_POOL, concurrency="8", **settings)[1] for _ in range(2)]
        db = stack.env["CALMQ_DATABASE_URL"]
        name = f"cache-{kind}-{uuid.uuid4().hex[:8]}"
        _tenant, key = create_tenant_id(db, name)
        yield Rig(kind, Api(api, key), db, url, ports, name, stack)
    finally:
        procs.stop_all()
        processes.stop(pid)


def _post(url: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10):
        pass


def _submit(rig: Rig, n: int, tag: str) -> list[str]:
    """``n`` jobs; every third one's first call fails (503), so it is retried."""
    ids = []
    for i in range(n):
        data: dict[str, Any] = {"text": f"{tag} question {i:03d}: how long is a lease?"}
        if i % 3 == 0:
            data.update(mode="flaky", fail_times=1)
        status, _h, body = rig.api.call("POST", "/v1/jobs", {"workflow": "handbook_cached",
                                                             "input": data})
        assert status == 202, body
        ids.append(str(body["job_id"]))
    return ids


def _run(rig: Rig, ids: list[str]) -> None:
    with psycopg.connect(rig.db, autocommit=True) as conn:
        wait_for(lambda: all_completed(conn, ids), timeout=120, what="the handbook jobs")


def _bill(usage: dict[str, dict[str, int]]) -> float:
    """The fake's usage of one job's calls, per model, at PRICES."""
    return sum(cost_usd(PRICES, "any", model, u["input_tokens"], u["output_tokens"],
                        cached_input_tokens=u["cached_input_tokens"],
                        cache_write_tokens=u["cache_creation_input_tokens"])
               for model, u in usage.items())


def test_a_shared_prefix_is_billed_cached_and_each_job_costs_what_the_fake_bills(
        rig: Rig) -> None:
    """Retries and a fallback included: >= 90 % of the prefix tokens of every answered call
    cached at the fake; each job's cost equals the fake's bill of its calls within 1 %, its
    cached tokens exactly what the fake served from its cache."""
    before = _run_phases(rig)
    ids = before["ids"]
    billed = fake_stats(rig.provider)["billed"]
    with psycopg.connect(rig.db, autocommit=True, row_factory=dict_row) as conn:
        jobs = {str(r["id"]): r for r in conn.execute(
            "SELECT id, attempt, cost_usd, input_tokens, cached_input_tokens,"
            " cache_write_tokens, cache_saved_usd,"
            " (SELECT sum(a.model_calls) FROM job_attempts a WHERE a.job_id = j.id) AS calls,"
            " (SELECT count(*) FROM job_attempts a WHERE a.job_id = j.id) AS attempts,"
            " (SELECT array_agg(DISTINCT a.model) FROM job_attempts a"
            "  WHERE a.job_id = j.id) AS models"
            " FROM jobs j WHERE id = ANY(%s::uuid[])", (ids,)).fetchall()}
    assert set(jobs) == set(ids)
    # The run had retries (the flaky jobs' second attempt) and a fallback (SECOND served).
    assert sum(int(j["attempts"]) > 2 for j in jobs.values()) >= len(ids) // 3
    assert any(SECOND in j["models"] for j in jobs.values())
    assert any(FIRST in j["models"] for j in jobs.values())
    calls = sum(int(j["calls"]) for j in jobs.values())
    assert calls == 2 * len(ids)  # one answered call a step
    cached = sum(u["cached_input_tokens"] for i in ids for u in billed[i].values())
    eligible = PREFIX_TOKENS * calls
    print(f"{rig.kind}: {cached} of {eligible} prefix tokens cached at the fake "
          f"({cached / eligible:.1%}) over {calls} calls")
    assert cached >= 0.9 * eligible
    for job_id, job in jobs.items():
        usage = billed[job_id]
        bill = _bill(usage)
        assert float(job["cost_usd"]) == pytest.approx(bill, rel=0.01), (job_id, usage)
        assert job["input_tokens"] == sum(u["input_tokens"] for u in usage.values())
        assert job["cached_input_tokens"] == sum(
            u["cached_input_tokens"] for u in usage.values())
        assert job["cache_write_tokens"] == sum(
            u["cache_creation_input_tokens"] for u in usage.values())
    assert sum(float(j["cache_saved_usd"]) for j in jobs.values()) > 0
    if rig.kind == "anthropic":  # a write per model: the first call of each
        assert sum(int(j["cache_write_tokens"]) for j in jobs.values()) >= PREFIX_TOKENS
    # The API's usage of a job names its cache fields.
    status, _h, body = rig.api.call("GET", f"/v1/jobs/{ids[-1]}")
    assert status == 200
    assert body["usage"]["cached_input_tokens"] == jobs[ids[-1]]["cached_input_tokens"]
    _shown(rig, jobs, before["metrics"])


def _accepted_metric(rig: Rig, name: str) -> float:
    """``name`` summed over the workers and the API (a review's approval counts there)."""
    with urllib.request.urlopen(rig.api.base_url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    api = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{"))
    return api + sum(metric(p, name) or 0.0 for p in rig.ports)


def _run_phases(rig: Rig) -> dict[str, Any]:
    """Twelve jobs on FIRST; then FIRST answers 429 and twelve more move to SECOND; then two
    that wait for a review after their last step, approved in the API."""
    metrics = {name: _accepted_metric(rig, name)
               for name in ("calmq_job_accepted_jobs_total",
                            "calmq_job_accepted_cost_usd_total")}
    first = _submit(rig, 12, "first")
    _run(rig, first)
    _post(f"{rig.provider}/admin/outage", {"seconds": 600, "statuses": [429],
                                           "model": FIRST, "retry_after_seconds": 600})
    second = _submit(rig, 12, "second")
    _run(rig, second)
    reviewed = []
    for i in range(2):
        status, _h, body = rig.api.call("POST", "/v1/jobs", {
            "workflow": "handbook_cached",
            "input": {"text": f"reviewed question {i}", "mode": "low_confidence"}})
        assert status == 202, body
        reviewed.append(str(body["job_id"]))
    with psycopg.connect(rig.db, autocommit=True) as conn:
        def waiting() -> bool:
            row = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s::uuid[])"
                               " AND status = 'awaiting_review'", (reviewed,)).fetchone()
            return bool(row and row[0] == len(reviewed))

        wait_for(waiting, timeout=60, what="the jobs to wait for review")
    for job_id in reviewed:
        status, _h, body = rig.api.call("POST", f"/v1/jobs/{job_id}/review",
                                        {"decision": "approve", "reviewer": "ana"})
        assert status == 200, body
    _run(rig, reviewed)
    return {"ids": first + second + reviewed, "metrics": metrics}


def _shown(rig: Rig, jobs: dict[str, dict[str, Any]], before: dict[str, float]) -> None:
    """The workers' metrics and `calmq costs` show the cache and the cost per accepted job."""
    total = sum(float(j["cost_usd"]) for j in jobs.values())

    def counted() -> bool:
        return _accepted_metric(rig, "calmq_job_accepted_jobs_total") \
            - before["calmq_job_accepted_jobs_total"] >= len(jobs)

    wait_for(counted, timeout=30, what="the accepted jobs in the workers' and API's metrics")
    accepted_cost = _accepted_metric(rig, "calmq_job_accepted_cost_usd_total") \
        - before["calmq_job_accepted_cost_usd_total"]
    assert accepted_cost == pytest.approx(total, rel=0.01)
    read = sum(metric(p, "calmq_model_cache_tokens_total") or 0.0 for p in rig.ports)
    assert read >= sum(int(j["cached_input_tokens"]) for j in jobs.values())
    assert sum(metric(p, "calmq_model_cache_saved_usd_total") or 0.0 for p in rig.ports) > 0
    done = calmq(rig.stack, "costs", "--tenant", rig.tenant, "--window", "1h", "-o", "json",
                 env=calmq_env(rig.stack))
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["workflow"], r["tenant"]) for r in rows] == [("handbook_cached", rig.tenant)]
    row = rows[0]
    assert (row["jobs"], row["accepted"]) == (len(jobs), len(jobs))
    assert row["cost_per_accepted_job_usd"] == pytest.approx(total / len(jobs), rel=1e-6)
    assert row["cached_share"] >= 0.5
