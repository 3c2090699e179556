"""/metrics of every component during real runs: the fleet metrics of docs/reference/metrics.md
are there with sane values, and the queue age follows a pool's backlog."""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from calmq import topics
from calmq.tooling.devstack import StackState
from tests.support.waiting import wait_for
from tests.support.workers import BASE, Env, forwarded_env

pytestmark = pytest.mark.integration

Samples = list[tuple[str, dict[str, str], float]]
SETTINGS: dict[str, Any] = dict(BASE)  # short lease, quick retry tiers
WORKERS: list[str] = []  # /metrics of the workers this module started


@pytest.fixture(scope="module")
def env(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from forwarded_env(stack, tmp_path_factory.mktemp("metrics-logs"))


def _worker(env: Env, pool: str, **settings: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start a worker of ``pool``; returns it and its /metrics URL (remembered in WORKERS)."""
    merged: dict[str, Any] = {**SETTINGS, **settings}
    proc, port = env.procs.worker(pool, **merged)
    WORKERS.append(f"http://127.0.0.1:{port}/metrics")
    return proc, WORKERS[-1]


def _url(stack: StackState, part: str) -> str:
    return next(p.address for p in stack.parts if p.name == part) + "/metrics"


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels``; None when there is none."""
    found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
    return sum(found) if found else None


def test_queue_age_rises_while_no_worker_runs_and_falls_after(env: Env) -> None:
    """A pool's calmq_queue_age_seconds grows while it has no worker and is 0 once one drains it."""
    pool = env.pool("age")
    ids = env.submit(pool, {"text": "queued while no worker runs"}, {"text": "and another"})
    api = _url(env.stack, "api")

    def age() -> float | None:
        return value(scrape(api), "calmq_queue_age_seconds", pool=pool, priority="interactive")

    first = wait_for(lambda: (a := age()) is not None and a > 0 and a, timeout=30,
                     what="a queue age for the pool")
    wait_for(lambda: (a := age()) is not None and a >= first + 2, timeout=30,
             what="the queue age to rise while no worker runs")
    _worker(env, pool)
    assert [env.finished(j)["status"] for j in ids] == ["completed", "completed"]
    wait_for(lambda: age() == 0, timeout=30, what="the queue age to fall to 0")


def test_every_fleet_metric_has_sane_values_after_a_run(env: Env) -> None:
    """After a mixed run every component's /metrics shows each fleet metric with fitting values."""
    pool = env.pool("run")
    _proc, worker = _worker(env, pool, consumer_lag_interval_seconds="1")
    ok, flaky, dead, review = env.submit(
        pool, {"text": "fine", "delay_ms": 200}, {"text": "flaky", "mode": "flaky",
                                                  "fail_times": 1},
        {"text": "bad", "mode": "bad_request"}, {"text": "blurry", "mode": "low_confidence"})
    assert env.finished(ok)["status"] == "completed"
    assert env.finished(flaky)["status"] == "completed"
    assert env.finished(dead)["status"] == "dead_letter"
    wait_for(lambda: env.api.job(review)["status"] == "awaiting_review", timeout=60,
             what="the low-confidence job to wait for review")
    status, _h, body = env.api.call("POST", f"/v1/jobs/{review}/review",
                                    {"decision": "approve", "reviewer": "metrics-test"})
    assert status == 200, body
    [idle] = env.submit(env.pool("idle"), {"text": "cancelled before any worker"})
    status, _h, body = env.api.call("POST", f"/v1/jobs/{idle}/cancel")
    assert status == 200, body
    assert env.finished(env.api.submit({"text": "through the API"}))["status"] == "completed"

    w = scrape(worker)
    wf = {"workflow": "summarize"}
    assert (value(w, "calmq_job_latency_seconds_count", **wf) or 0) >= 2
    assert (value(w, "calmq_job_latency_seconds_sum", **wf) or 0) > 0.2
    assert value(w, "calmq_job_attempts_count", **wf) == 2  # ok and flaky
    assert value(w, "calmq_job_attempts_sum", **wf) == 3  # 1 + 2 attempts
    assert (value(w, "calmq_attempt_model_seconds_count", **wf) or 0) >= 5
    assert (value(w, "calmq_attempt_model_seconds_sum", **wf) or 0) >= 0.2  # the delay_ms
    assert (value(w, "calmq_attempt_other_seconds_count", **wf) or 0) >= 5
    assert (value(w, "calmq_retries_total", failure_class="transient") or 0) >= 1
    assert (value(w, "calmq_retry_delay_seconds_count", failure_class="transient") or 0) >= 1
    assert (value(w, "calmq_retry_delay_seconds_sum", failure_class="transient") or 0) > 0
    assert value(w, "calmq_dead_letters_total", failure_class="input") == 1
    assert value(w, "calmq_lease_expirations_total") is not None
    assert 0 <= (value(w, "calmq_worker_saturation") or 0) <= 1
    assert (value(w, "calmq_model_tokens_total", workflow="summarize") or 0) > 0
    assert (value(w, "calmq_model_cost_usd_total", workflow="summarize") or 0) >= 0
    topic = topics.topic_for_route(topics.work_route(pool, "interactive"))
    wait_for(lambda: value(scrape(worker), "calmq_consumer_lag_messages", topic=topic) == 0,
             timeout=30, what="the consumer lag of the drained pool to read 0")

    a = scrape(_url(env.stack, "api"))
    assert (value(a, "calmq_jobs_accepted_total") or 0) >= 1
    assert (value(a, "calmq_jobs_cancelled_total") or 0) >= 1
    assert (value(a, "calmq_review_wait_seconds_count", outcome="approve") or 0) >= 1
    assert (value(a, "calmq_review_wait_seconds_sum", outcome="approve") or 0) > 0
    r = scrape(_url(env.stack, "relay"))
    assert (value(r, "calmq_relay_slot_lag_seconds") or 0) >= 0
    assert value(r, "calmq_relay_slot_lag_bytes") is not None
    assert (value(r, "calmq_relay_published_total") or 0) > 0


def test_a_killed_workers_expired_lease_is_counted(env: Env) -> None:
    """A killed worker's expired lease is requeued and counted in calmq_lease_expirations_total."""
    pool = env.pool("lease")
    proc, _url_killed = _worker(env, pool)
    [job] = env.submit(pool, {"text": "slow", "delay_ms": 30000})
    wait_for(lambda: env.api.job(job)["status"] == "running", timeout=30,
             what="the job to be running")
    # Any worker's housekeeping reaps any pool's expired leases: the stack's, one this
    # module started before, or a new one; count over all of them but the one killed.
    live = [_url(env.stack, "worker"), *WORKERS[:-1]]

    def expirations() -> float:
        return sum(value(scrape(url), "calmq_lease_expirations_total") or 0 for url in live)

    before = expirations()
    proc.kill()
    proc.wait(timeout=10)
    _worker(env, env.pool("reaper"))
    live.append(WORKERS[-1])

    wait_for(lambda: expirations() >= before + 1, timeout=30, what="a counted lease expiration")
    assert any(e["type"] == "requeued_after_restart" for e in env.api.job(job)["events"])


def test_every_workflow_pool_has_a_queue_age_series_from_the_start(env: Env) -> None:
    """The API lists each pool its workflows route to (summarize: default) for both
    priorities, whether or not one of its jobs was waiting at a sample."""
    samples = scrape(_url(env.stack, "api"))
    for priority in ("interactive", "bulk"):
        assert value(samples, "calmq_queue_age_seconds", pool="default",
                     priority=priority) is not None, priority
