"""``calmq bench priority``: what an interactive job experiences behind a bulk backlog.

The seed's rule: interactive work gets its own topic and a reserved share of the provider's
budget, so a bulk backfill must not delay it. One run measures the same interactive load
twice on the same stack: first with nothing else queued (the baseline ``no_backlog``), then
with ``size`` bulk jobs queued and the fleet budget saturated by them.

The budget is the provider's request limit (``CALMQ_BUDGET_REQUESTS_PER_MINUTE`` equal to
the fake provider's ``--requests-per-minute``): every summarize call asks for about the same
tokens, so a share of requests is a share of tokens, and the figure does not depend on
token estimates. The bulk backlog alone asks for far more than the budget (``size`` jobs
against ~2 minutes of budget), so the budget is saturated for the whole measured minute.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

from bench import loadgen
from bench.common import completed, wait
from bench.histograms import quantiles, scrape
from bench.loadgen import percentile
from bench.procs import Phase, Sampler
from bench.report import result
from bench.rig import Rig

__all__ = ["DEFAULT_SIZE", "body", "interactive_pass", "priority", "stack", "tail_breakdown",
           "turnaround_ms"]

DEFAULT_SIZE = 50_000
PROVIDER_LATENCY_MS = 500
# 150 calls/s: the interactive share (0.2 by default) is 30 calls/s, above the 20/s of
# interactive load, and bulk gets 120 calls/s, far less than 50,000 queued jobs ask for.
BUDGET_RPM = 9000
INTERACTIVE_RATE = 20.0
INTERACTIVE_SECONDS = 60.0
WORKERS = 2
# After the backlog is submitted: time for the budget to settle at its saturated rate.
SATURATE_SECONDS = 15.0

Log = Any


def body(priority: str) -> dict[str, Any]:
    return {"workflow": "summarize", "priority": priority,
            "input": {"text": "Kafka and PostgreSQL carry slow AI jobs.", "mode": "success"}}


def turnaround_ms(rig: Rig, tenant_id: str) -> list[float]:
    """Submit→completion per completed job: its 'queued' event (written in the accepting
    transaction) to its 'completed' event, both on the database's clock."""
    rows = rig.query(
        """SELECT extract(epoch FROM c.at - q.at) * 1000
           FROM jobs j JOIN job_events q ON q.job_id = j.id AND q.type = 'queued'
                       JOIN job_events c ON c.job_id = j.id AND c.type = 'completed'
           WHERE j.tenant_id = %s""", (tenant_id,))
    return [float(r[0]) for r in rows]


def tail_breakdown(rig: Rig, tenant_id: str, share: float = 0.05) -> dict[str, Any]:
    """Where the slowest ``share`` of a tenant's completed jobs spent their time, against
    the others: submit to the first attempt's start (relay, Kafka, claim, holds), the
    attempts (budget admission and the provider's call), the last attempt's end to
    ``completed`` (the finishing transaction); with the extra attempts and holds they met.
    Medians per group, so one figure says which segment a p99 comes from."""
    rows = rig.query(
        """SELECT extract(epoch FROM c.at - q.at) * 1000,
                  extract(epoch FROM min(a.started_at) - q.at) * 1000,
                  extract(epoch FROM max(a.finished_at) - min(a.started_at)) * 1000,
                  extract(epoch FROM c.at - max(a.finished_at)) * 1000,
                  count(a.*),
                  (SELECT string_agg(w.detail->>'reason', ',') FROM job_events w
                    WHERE w.job_id = j.id AND w.type = 'waiting')
           FROM jobs j JOIN job_events q ON q.job_id = j.id AND q.type = 'queued'
                       JOIN job_events c ON c.job_id = j.id AND c.type = 'completed'
                       JOIN job_attempts a ON a.job_id = j.id
           WHERE j.tenant_id = %s GROUP BY j.id, q.at, c.at""", (tenant_id,))
    if not rows:
        return {}
    rows = sorted(rows, key=lambda r: float(r[0]))
    cut = max(1, round(len(rows) * share))
    groups = {"slowest": rows[-cut:], "rest": rows[:-cut]}

    def med(group: list[Any], i: int) -> float:
        return round(percentile([float(r[i]) for r in group], 50), 1) if group else 0.0

    return {name: {"jobs": len(g), "turnaround_ms": med(g, 0), "to_first_attempt_ms": med(g, 1),
                   "attempts_ms": med(g, 2), "finish_ms": med(g, 3),
                   "jobs_with_retries": sum(1 for r in g if int(r[4]) > 1),
                   "jobs_with_waits": sum(1 for r in g if r[5]),
                   "waits_by_reason": dict(Counter(x for r in g if r[5]
                                                   for x in str(r[5]).split(",")))}
            for name, g in groups.items()}




def _attempts_between(rig: Rig, t0: float, t1: float) -> dict[str, int]:
    """Model calls that ended in [t0, t1] (epoch seconds), by the job's priority."""
    rows = rig.query(
        """SELECT j.priority, count(*) FROM job_attempts a JOIN jobs j ON j.id = a.job_id
           WHERE a.finished_at BETWEEN to_timestamp(%s) AND to_timestamp(%s)
           GROUP BY j.priority""", (t0, t1))
    return {str(p): int(n) for p, n in rows}


def _failed_between(rig: Rig, t0: float, t1: float) -> dict[str, int]:
    """Failed calls that ended in [t0, t1], by priority and code: a 429 despite the budget
    pauses the model fleet-wide, interactive calls included."""
    rows = rig.query(
        """SELECT j.priority || ':' || coalesce(a.error_code, '?'), count(*)
           FROM job_attempts a JOIN jobs j ON j.id = a.job_id
           WHERE a.finished_at BETWEEN to_timestamp(%s) AND to_timestamp(%s)
             AND a.outcome IS DISTINCT FROM 'completed'
           GROUP BY 1""", (t0, t1))
    return {str(k): int(n) for k, n in rows}


def interactive_pass(rig: Rig, url: str, seconds: float, label: str,
                      log: Log) -> tuple[dict[str, Any], float, float, int]:
    """The interactive load at INTERACTIVE_RATE for ``seconds`` as a tenant of its own: its
    submit-to-completion figures and tail, and the window (epoch seconds) it ran in."""
    tenant_id, key = rig.tenant(f"bench-{label}-{uuid.uuid4().hex[:6]}")
    log(f"  calmq: interactive jobs at {INTERACTIVE_RATE:.0f}/s for {seconds:.0f} s ({label})")
    t0 = time.time()
    load = asyncio.run(loadgen.open_loop(url, body("interactive"),
                                         {"Authorization": f"Bearer {key}"},
                                         rate=INTERACTIVE_RATE, seconds=seconds))
    t1 = time.time()
    done = wait(lambda: completed(rig, tenant_id), load.ok, 60, f"interactive ({label})", log)
    lat = turnaround_ms(rig, tenant_id)
    figures: dict[str, Any] = {"interactive_p50_ms": round(percentile(lat, 50), 1),
               "interactive_p99_ms": round(percentile(lat, 99), 1),
               "interactive_completed": done, "interactive_submitted": load.ok,
               "interactive_submit_errors": sum(load.errors.values()),
               "interactive_tail": tail_breakdown(rig, tenant_id)}
    return figures, t0, t1, done


def stack(rig: Rig, log: Log) -> tuple[str, dict[str, str], list[str]]:
    """The rig: the fake provider's limit as the fleet budget, an API, relay and
    forwarder, two workers, warm; returns (jobs URL, the processes' env, the workers)."""
    fp = rig.calmq("fake-provider", "--latency-ms", str(PROVIDER_LATENCY_MS),
                   "--requests-per-minute", str(BUDGET_RPM))
    env = {"CALMQ_FAKE_PROVIDER_URL": fp.url,
           "CALMQ_BUDGET_REQUESTS_PER_MINUTE": str(BUDGET_RPM)}
    api = rig.calmq("api", env=env)
    rig.calmq("relay", env=env)
    rig.calmq("forwarder", env=env)
    names = [f"worker:p{i}" for i in range(WORKERS)]
    for name in names:
        rig.calmq(name, env=env)
    url = f"{api.url}/v1/jobs"
    warm_id, key = rig.tenant(f"bench-warm-{uuid.uuid4().hex[:6]}")
    asyncio.run(loadgen.closed_loop(url, body("interactive"),
                                    {"Authorization": f"Bearer {key}"}, total=40,
                                    concurrency=8))
    wait(lambda: completed(rig, warm_id), 40, 60, "warm-up jobs", log)
    return url, env, names


def priority(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    # Smoke runs (--size below the default) shorten the interactive minute in proportion,
    # never below 10 s; the full size is the minute.
    seconds = max(10.0, min(INTERACTIVE_SECONDS, INTERACTIVE_SECONDS * size / DEFAULT_SIZE))
    with Rig(log=log) as rig:
        url, _env, names = stack(rig, log)

        # Where an attempt's time goes (budget wait by priority, the provider, the rest, the
        # loop's lag), per pass: the tail has been inside the attempt, not in a hold.
        scraped = scrape(rig, names)
        quiet, _q0, _q1, _qn = interactive_pass(rig, url, seconds, "no-backlog", log)
        quiet["worker_histograms"] = quantiles(scraped, scrape(rig, names))

        bulk_id, key = rig.tenant(f"bench-bulk-{uuid.uuid4().hex[:6]}")
        log(f"  calmq: {size} bulk jobs queued behind a budget of {BUDGET_RPM} calls/min")
        bulk = asyncio.run(loadgen.closed_loop(url, body("bulk"),
                                               {"Authorization": f"Bearer {key}"}, total=size,
                                               concurrency=64))
        time.sleep(SATURATE_SECONDS)  # let the budget settle at its saturated rate
        # What PostgreSQL spends in the window, per statement: the flood's cost per job
        # (fair share's holds and picks, the claims, the budget) is what the tail shares
        # the two cores with.
        rig.statements_reset(tables=False)
        phase: Phase = sampler.phase({**rig.pids(*names, "api", "relay"), **rig.infra_pids()})
        bulk_before = completed(rig, bulk_id)
        scraped = scrape(rig, names)
        busy, b0, b1, _bn = interactive_pass(rig, url, seconds, "with-backlog", log)
        busy["worker_histograms"] = quantiles(scraped, scrape(rig, names))
        sampler.end(phase)
        bulk_after = completed(rig, bulk_id)
        calls = _attempts_between(rig, b0, b1)
        statements = rig.statements(max(sum(calls.values()), 1), top=15)
        failed = _failed_between(rig, b0, b1)
        window = max(b1 - b0, 1e-3)
        total_calls = sum(calls.values())
        figures: dict[str, Any] = {
            **busy,
            "bulk_jobs_per_s": round(calls.get("bulk", 0) / window, 1),
            "interactive_budget_share": round(calls.get("interactive", 0) / total_calls, 3)
            if total_calls else 0.0,
            # Calls that ended in the window ÷ what the budget allows in it.
            "budget_used": round(total_calls / (BUDGET_RPM / 60 * window), 3),
            "failed_calls_in_window": failed,
            "bulk_queued": bulk.ok, "bulk_completed_in_window": bulk_after - bulk_before,
            "bulk_left_at_end": bulk.ok - bulk_after,
            "budget_requests_per_minute": BUDGET_RPM, "provider_latency_ms": PROVIDER_LATENCY_MS,
            "interactive_rate": INTERACTIVE_RATE, "interactive_seconds": seconds,
            "workers": WORKERS,
            "cpu_s_per_1000_jobs": round(sum(phase.cpu.values()) * 1000
                                         / max(total_calls, 1), 3),
            "cpu_ms_per_job_by_process": {
                name: round(s * 1000 / max(total_calls, 1), 3)
                for name, s in sorted(phase.cpu.items())},
        }
        if figures["bulk_left_at_end"] <= 0:
            log("  warning: the bulk backlog ran out during the measured window; "
                "use a larger --size")
        versions = rig.versions
    res = result("priority", size, figures, {"no_backlog": quiet},
                 {"interactive_p99_ms_vs_no_backlog": round(
                     busy["interactive_p99_ms"] / quiet["interactive_p99_ms"], 3)
                  if quiet["interactive_p99_ms"] else 0.0,
                  "interactive_p50_ms_vs_no_backlog": round(
                      busy["interactive_p50_ms"] / quiet["interactive_p50_ms"], 3)
                  if quiet["interactive_p50_ms"] else 0.0},
                 versions, extra_versions={"load_generator": loadgen.NAME})
    # Per call that ended in the window (ms_per_job), the heaviest first.
    res["pg_statements_in_window"] = statements
    return res
