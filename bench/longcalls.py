"""``calmq bench longcalls``: one worker process holding thousands of long model calls.

Real model calls take 5-60 s with a long tail: with a 10 s call, 500 jobs/s needs 5,000
calls in flight. ``size`` jobs are queued first; then ONE worker with ``--concurrency
5000`` drains them against a provider whose latency is log-normal (median 8 s, p99 40 s).

By Little's law the most such a worker can do is in-flight ÷ mean latency (~492 jobs/s
here): ``jobs_per_s_vs_ideal`` is the rate in the steady window (after the first p99 of
start-up, while jobs are still being claimed, so every slot has work) over that ideal.
Beside it: the worker's peak RSS and CPU per job, its event-loop lag and commit lag (from
its own /metrics), and lease expiries (must be 0: 5,000 leases heartbeat in one statement
every third of a lease).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from bench import loadgen
from bench.procs import Sampler
from bench.report import result
from bench.rig import Rig
from bench.scrape import scrape
from calmq.tooling.latency import parse_latency

__all__ = ["DEFAULT_SIZE", "longcalls"]

DEFAULT_SIZE = 60_000
IN_FLIGHT = 5000
LATENCY = "lognormal:median=8s,p99=40s"
# The summarize step's own timeout is 60 s, which ~0.2 % of these calls exceed (p99.9 is
# ~67 s): a timeout would be a retry, not the worker's cost, so steps get 10 minutes.
STEP_TIMEOUT_S = 600

Log = Any


def _wait(check: Any, target: int, timeout: float, what: str, log: Log) -> int:
    deadline = time.monotonic() + timeout
    value = check()
    while value < target and time.monotonic() < deadline:
        time.sleep(0.5)  # a polling interval under a deadline
        value = check()
    if value < target:
        log(f"  {what}: only {value} of {target} within {timeout:.0f} s")
    return int(value)


def _completed(rig: Rig, tenant_id: str) -> int:
    return int(rig.query("SELECT count(*) FROM jobs WHERE tenant_id = %s AND "
                         "status = 'completed'", (tenant_id,))[0][0])


def _published(rig: Rig, topic: str) -> int:
    from bench.common import high_watermark

    return high_watermark(rig.bootstrap, topic)


def _times(rig: Rig, tenant_id: str) -> tuple[list[float], list[float]]:
    """Epoch seconds of every first 'running' (claim) and every 'completed' event."""
    rows = rig.query(
        """SELECT e.type, extract(epoch FROM e.at) FROM job_events e JOIN jobs j
           ON j.id = e.job_id WHERE j.tenant_id = %s AND e.type IN ('running', 'completed')""",
        (tenant_id,))
    running = sorted(float(t) for k, t in rows if k == "running")
    completed = sorted(float(t) for k, t in rows if k == "completed")
    return running, completed


def longcalls(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    dist = parse_latency(LATENCY)
    in_flight = min(IN_FLIGHT, size)
    ideal = in_flight / dist.mean
    with Rig(log=log) as rig:
        fp = rig.calmq("fake-provider", "--latency-dist", LATENCY)
        env = {"CALMQ_FAKE_PROVIDER_URL": fp.url,
               "CALMQ_STEP_TIMEOUT_SECONDS": str(STEP_TIMEOUT_S)}
        api = rig.calmq("api", env=env)
        rig.calmq("relay", env=env)
        tenant_id, key = rig.tenant(f"bench-long-{uuid.uuid4().hex[:6]}")
        log(f"  calmq: {size} jobs queued; provider latency {dist.describe()}")
        load = asyncio.run(loadgen.closed_loop(
            f"{api.url}/v1/jobs",
            {"workflow": "summarize", "priority": "bulk",
             "input": {"text": "Kafka and PostgreSQL carry slow AI jobs.", "mode": "success"}},
            {"Authorization": f"Bearer {key}"}, total=size, concurrency=64))
        rig.stop("api")
        _wait(lambda: _published(rig, "calmq.default.bulk"), load.ok, 120 + size / 500,
              "relay", log)
        log(f"  calmq: one worker with --concurrency {IN_FLIGHT} drains them "
            f"(ideal {ideal:.0f} jobs/s)")
        phase = sampler.phase({**rig.pids("relay", "fake-provider"), **rig.infra_pids()})
        worker = rig.calmq("worker", "--concurrency", str(IN_FLIGHT), env=env)
        phase.pids["worker"] = worker.pid
        done = _wait(lambda: _completed(rig, tenant_id), load.ok,
                     180 + 2 * load.ok / ideal, "long calls", log)
        sampler.end(phase)
        metrics = scrape(worker.url)
        running, completed = _times(rig, tenant_id)
        expired = int(rig.query(
            """SELECT count(*) FROM job_events e JOIN jobs j ON j.id = e.job_id
               WHERE j.tenant_id = %s AND e.type = 'requeued_after_restart'""",
            (tenant_id,))[0][0])
        rig.stop("worker")
        rig.stop("relay")
        from bench.common import hot_share

        # After the processes are gone (their backends flushed their table counters): how
        # many job updates (claims, heartbeats, finishes) were HOT.
        jobs_table = hot_share(rig.table_updates("jobs"))
        # The steady window: from the first claim plus the p99 (calls of the first wave
        # have ended, or nearly) to the last claim (until then every freed slot had a job).
        w0 = (running[0] if running else 0.0) + dist.p99
        w1 = running[-1] if running else 0.0
        steady = w1 - w0 >= 10
        if not steady:
            # A smoke size has no steady window: the whole run, first claim to last answer.
            w0 = running[0] if running else 0.0
            w1 = completed[-1] if completed else w0
            log("  note: too few jobs for a steady window; jobs_per_s is over the whole run")
        in_window = sum(1 for t in completed if w0 <= t <= w1)
        rate = in_window / max(w1 - w0, 1e-3)
        span = (completed[-1] - running[0]) if completed and running else 0.0
        cpu_worker = phase.cpu.get("worker", 0.0)
        figures = {
            "jobs_per_s": round(rate, 1), "ideal_jobs_per_s": round(ideal, 1),
            "jobs_per_s_vs_ideal": round(rate / ideal, 3),
            "jobs_per_s_whole_run": round(done / max(span, 1e-3), 1),
            "steady_window_s": round(w1 - w0, 1) if steady else 0.0,
            "worker_peak_rss_mb": round(phase.peak_rss_mb.get("worker", 0.0), 1),
            "worker_cpu_ms_per_job": round(cpu_worker * 1000 / max(done, 1), 3),
            "loop_lag_p99_ms": round(metrics.quantile("calmq_event_loop_lag_seconds", 0.99)
                                     * 1000, 1),
            "loop_lag_p50_ms": round(metrics.quantile("calmq_event_loop_lag_seconds", 0.5)
                                     * 1000, 1),
            # The part of the loop lag that is the garbage collector (all generations).
            "gc_pauses": int(metrics.value("calmq_gc_pause_seconds_count")),
            "gc_pause_total_s": round(metrics.value("calmq_gc_pause_seconds_sum"), 2),
            "gc_pause_p99_ms": round(metrics.quantile("calmq_gc_pause_seconds", 0.99) * 1000, 1),
            # Requeues of this run's jobs because a lease lapsed (the reaper's or a claim's).
            "lease_expiries": expired,
            "lease_expirations_reaped": int(metrics.value("calmq_lease_expirations_total")),
            "attempts_aborted_lease_lost": int(metrics.value("calmq_attempts_aborted_total")),
            # Offsets commit as a contiguous prefix: with latencies this spread, the prefix
            # waits for the slowest call in it, so this is about the tail latency.
            "commit_lag_p99_s": round(metrics.quantile("calmq_commit_lag_seconds", 0.99), 3),
            "commit_lag_p50_s": round(metrics.quantile("calmq_commit_lag_seconds", 0.5), 3),
            "completed": done, "queued": load.ok, "in_flight": in_flight,
            "provider_latency": dist.describe(),
            "peak_rss_mb": round(phase.peak_rss_mb.get("worker", 0.0), 1),
            "cpu_s_per_1000_jobs": round(sum(phase.cpu.values()) * 1000 / max(done, 1), 3),
            "cpu_s_per_1000_jobs_worker": round(cpu_worker * 1000 / max(done, 1), 3),
            "pg_cpu_ms_per_job": round(phase.cpu.get("postgres", 0.0) * 1000 / max(done, 1), 3),
            # Every process on the host while the worker drains: on two cores, the worker's
            # loop waits for a core whenever these add up to nearly two.
            "cpu_ms_per_job_by_process": {
                name: round(seconds * 1000 / max(done, 1), 3)
                for name, seconds in sorted(phase.cpu.items())},
        }
        versions = rig.versions
    res = result("longcalls", size, figures, {}, {}, versions,
                 extra_versions={"load_generator": loadgen.NAME})
    res["jobs_table"] = jobs_table
    return res
