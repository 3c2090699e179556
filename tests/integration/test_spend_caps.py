"""Spend caps and the cost per job (issue 19).

A tenant past its daily spend cap has new work wait in ``queued`` with a visible reason
(``waiting_reason``, a ``waiting`` event; bulk first, interactive at the full cap), and it
resumes when the cap is raised, never dropped. The worker's /metrics show the cost of
attempts per workflow and tenant with what retries and dead letters cost apart.
"""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from calmq.tooling.devstack import StackState
from tests.support.api import Api
from tests.support.cli import calmq, new_tenant
from tests.support.waiting import wait_for
from tests.support.workers import (
    BASE,
    TERMINAL,
    TIERS,
    Procs,
    create_pool_topics,
    metric,
    submit,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def capped(stack: StackState, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, int]]:
    """A pool of this module's, its worker (spend caps read every 0.2 s) and a forwarder for
    its quick retry tiers."""
    procs = Procs(stack.env, tmp_path_factory.mktemp("spend-logs"))
    pool = f"spend{uuid.uuid4().hex[:6]}"
    create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], pool, TIERS.split(","))
    try:
        procs.forwarder(retry_tiers=TIERS)
        _proc, port = procs.worker(pool, spend_cap_refresh_seconds="0.2", **BASE)
        yield pool, port
    finally:
        procs.stop_all()


def _job(conn: psycopg.Connection[Any], job_id: str) -> dict[str, Any]:
    row = conn.execute("SELECT status, waiting_reason, cost_usd::float8 FROM jobs WHERE id = %s",
                       (job_id,)).fetchone()
    assert row is not None
    return {"status": row[0], "waiting_reason": row[1], "cost_usd": row[2]}


def _events(conn: psycopg.Connection[Any], job_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [(r[0], r[1]) for r in conn.execute(
        "SELECT type, detail FROM job_events WHERE job_id = %s ORDER BY id", (job_id,))]


def _finished(conn: psycopg.Connection[Any], job_id: str, timeout: float = 60) -> str:
    return str(wait_for(lambda: (s := _job(conn, job_id)["status"]) in TERMINAL and s,
                        timeout=timeout, what=f"job {job_id} to finish"))


def _set_cap(stack: StackState, name: str, daily: str) -> None:
    done = calmq(stack, "tenants", "set-spend-cap", name, "--daily-usd", daily)
    assert done.returncode == 0, done.stderr


def test_work_past_a_daily_cap_waits_in_queued_with_a_reason_and_resumes_when_raised(
        stack: StackState, capped: tuple[str, int]) -> None:
    """With spend at 95 % of the cap, bulk work waits and interactive still runs; past the
    cap interactive waits too; raising the cap resumes both and they complete."""
    pool, port = capped
    database_url = stack.env["CALMQ_DATABASE_URL"]
    name, tenant, key = new_tenant(stack, "spend")
    with psycopg.connect(database_url, autocommit=True) as conn:
        (first,) = submit(database_url, tenant, pool, [{"text": "what the day costs"}])
        assert _finished(conn, first) == "completed"
        spent = _job(conn, first)["cost_usd"]
        assert spent > 0
        # The gauges count every capped tenant of the database: other tests' tenants may be
        # capped already, so the worker has read this one's cap when its count moves on.
        bulk_gauge = 'calmq_spend_capped_tenants{priority="bulk"}'
        interactive_gauge = 'calmq_spend_capped_tenants{priority="interactive"}'
        capped_bulk = metric(port, bulk_gauge) or 0
        capped_interactive = metric(port, interactive_gauge) or 0
        _set_cap(stack, name, f"{spent / 0.95:.12f}")  # bulk waits from 90 %: it is at 95 %
        wait_for(lambda: (metric(port, bulk_gauge) or 0) > capped_bulk, timeout=30,
                 what="the worker to read the cap")
        (bulk,) = submit(database_url, tenant, pool, [{"text": "a bulk job over the cap"}],
                         priority="bulk")
        (interactive,) = submit(database_url, tenant, pool, [{"text": "an interactive one"}])
        wait_for(lambda: _job(conn, bulk)["waiting_reason"] == "spend_cap_daily",
                 timeout=30, what="the bulk job to wait for the cap")
        assert _finished(conn, interactive) == "completed"
        held = _job(conn, bulk)
        assert held["status"] == "queued"
        assert ("waiting", {"reason": "spend_cap_daily"}) in _events(conn, bulk)
        assert conn.execute("SELECT count(*) FROM job_attempts WHERE job_id = %s",
                            (bulk,)).fetchone() == (0,)

        # Visible to the tenant (GET /v1/jobs/{id}) and to the operator (calmq jobs show).
        view = Api(stack.env["CALMQ_API_URL"], key).job(bulk)
        assert view["status"] == "queued"
        assert view["waiting_reason"] == "spend_cap_daily"
        assert "waiting" in [e["type"] for e in view["events"]]
        shown = calmq(stack, "jobs", "show", bulk)
        assert shown.returncode == 0, shown.stderr
        assert "spend_cap_daily" in shown.stdout

        # The interactive job's cost took the spend past the cap: interactive waits too.
        wait_for(lambda: (metric(port, interactive_gauge) or 0) > capped_interactive,
                 timeout=30, what="the worker to see the cap passed")
        (late,) = submit(database_url, tenant, pool, [{"text": "interactive, past the cap"}])
        wait_for(lambda: _job(conn, late)["waiting_reason"] == "spend_cap_daily",
                 timeout=30, what="the interactive job to wait for the cap")

        _set_cap(stack, name, "1")
        for job_id in (bulk, late):
            assert _finished(conn, job_id) == "completed"
            assert "resumed" in [t for t, _d in _events(conn, job_id)]
            assert _job(conn, job_id)["waiting_reason"] is None


def _samples(port: int, name: str) -> list[Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        families = list(text_string_to_metric_families(resp.read().decode()))
    return [s for f in families for s in f.samples if s.name == name]


def test_cost_per_job_shows_retries_and_dead_letters_apart(
        stack: StackState, capped: tuple[str, int]) -> None:
    """A job that succeeds at once, one that succeeds on its retry and one whose model
    answer dead-letters it: /metrics has the cost of each kind of attempt for the workflow
    and tenant, and the jobs that ended, so cost per job is their quotient."""
    pool, port = capped
    database_url = stack.env["CALMQ_DATABASE_URL"]
    _name, tenant, _key = new_tenant(stack, "cost")
    ok, retried, dead = submit(database_url, tenant, pool, [
        {"text": "plain success"},
        {"text": "fails once, then succeeds", "mode": "flaky", "fail_times": 1},
        {"text": "the model answers garbage", "mode": "malformed"}])
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert _finished(conn, ok) == "completed"
        assert _finished(conn, retried) == "completed"
        assert _finished(conn, dead) == "dead_letter"
        costs = {j: _job(conn, j)["cost_usd"] for j in (ok, retried, dead)}

    def by_kind() -> dict[str, float]:
        return {s.labels["kind"]: s.value for s in _samples(port, "calmq_job_cost_usd_total")
                if s.labels.get("tenant") == str(tenant)
                and s.labels.get("workflow") == "summarize"}

    kinds = wait_for(lambda: (k := by_kind()) and {"first", "retry", "dead_letter"} <= set(k)
                     and k, timeout=30, what="the cost metric of every kind")
    assert kinds["retry"] > 0  # the retry's successful call (the failed one cost nothing)
    assert kinds["dead_letter"] == pytest.approx(costs[dead], rel=1e-6)
    assert sum(kinds.values()) == pytest.approx(sum(costs.values()), rel=1e-6)
    ended = [s.value for s in _samples(port, "calmq_job_cost_jobs_total")
             if s.labels.get("tenant") == str(tenant)]
    assert ended == [3.0]


def test_set_spend_cap_refuses_bad_amounts_and_unknown_tenants(stack: StackState) -> None:
    """The CLI answers a usage error for a negative or non-numeric cap and an error for a
    tenant that does not exist; set-quota likewise."""
    name, _tenant, _key = new_tenant(stack, "capcli")
    bad = calmq(stack, "tenants", "set-spend-cap", name, "--daily-usd", "-1")
    assert bad.returncode != 0
    assert "--daily-usd" in bad.stderr
    unknown = calmq(stack, "tenants", "set-spend-cap", f"nobody-{uuid.uuid4().hex[:6]}",
                    "--monthly-usd", "5")
    assert unknown.returncode != 0
    assert "no tenant named" in unknown.stderr
    quota = calmq(stack, "tenants", "set-quota", name, "--tokens-per-minute", "1200")
    assert quota.returncode == 0, quota.stderr
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        row = conn.execute("SELECT tokens_per_minute FROM tenants WHERE name = %s",
                           (name,)).fetchone()
    assert row == (1200,)
