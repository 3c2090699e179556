"""``calmq bench tiers``: the deadline picks the service tier (issue 46).

A mixed workload (a quarter each: interactive, and bulk jobs with deadlines of 15 minutes,
2 hours and 24 hours) runs twice on the same stack: once with calmq choosing the tier per
call (``CALMQ_SERVICE_TIERS=flex,priority``), once all at the standard tier (the baseline,
no tier sent). The fake provider serves ``gpt-5-mini`` (priced at flex and priority by
genai-prices), its flex tier four times slower than the standard and refusing 20 % of flex
calls for capacity (OpenAI's 429 ``resource_unavailable``).

Time is scaled down ``TIME_SCALE`` times: a 15-minute deadline is 9 s, 2 hours 72 s,
24 hours 864 s, and the fake's standard latency of 50 ms and flex latency of 1 s stand for
5 s and 100 s. (Scaled 300 times, a 15-minute deadline was 3 s, and a machine under load
missed deadlines by its event loop's lag alone.) Interactive jobs carry a deadline of 5 s,
not scaled. The 24-hour jobs stay online (the summarize workflow's bulk lane), so they show the
tier choice rather than the batch lane, which costs about what flex costs.

Figures: the cost of each run (the jobs' recorded cost) and its ratio, deadlines met,
every flex refusal and how long its move to the standard tier took (from the attempts'
history), attempts beyond one a job, and calls sent at ``priority``. Per deadline class,
the wait from submit to the first attempt's start and the misses that never ran, and the
load average at the end: the scaled deadlines (9 s for 15 minutes) do not scale the
stack's own queueing, which on a loaded machine alone takes seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
import uuid
from typing import Any

import aiohttp

from bench.common import Log, ratio, wait
from bench.procs import Sampler
from bench.report import result
from bench.rig import Rig

__all__ = ["DEFAULT_SIZE", "tiers"]

DEFAULT_SIZE = 2000
MODEL = "gpt-5-mini"
TIME_SCALE = 100
# name, priority, deadline_seconds as submitted (scaled down TIME_SCALE times, but the
# interactive one), the deadline it stands for
CLASSES = (("interactive", "interactive", 5, "5 s (interactive, not scaled)"),
           ("15m", "bulk", 15 * 60 // TIME_SCALE, "15 minutes"),
           ("2h", "bulk", 2 * 3600 // TIME_SCALE, "2 hours"),
           ("24h", "bulk", 24 * 3600 // TIME_SCALE, "24 hours"))
STANDARD_MS = 50
FLEX_MS = 1000
FLEX_REFUSAL = 0.2
SUBMIT_RATE = 100.0  # jobs a second, the classes interleaved
CONCURRENCY = 400


def _post(url: str) -> Any:
    req = urllib.request.Request(url, data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read() or b"{}")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


async def _submit(url: str, key: str, size: int) -> int:
    """``size`` jobs at SUBMIT_RATE a second, the classes in turn; the accepted count."""
    headers = {"Authorization": f"Bearer {key}"}
    accepted = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal accepted
        name, priority, deadline, _ = CLASSES[i % len(CLASSES)]
        body = {"workflow": "summarize", "priority": priority, "deadline_seconds": deadline,
                "metadata": {"deadline_class": name},
                "input": {"text": f"Kafka and PostgreSQL carry slow AI jobs ({i}).",
                          "mode": "success"}}
        async with session.post(url, json=body, headers=headers) as resp:
            accepted += resp.status == 202

    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        tasks = []
        for i in range(size):
            delay = t0 + i / SUBMIT_RATE - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the schedule, not a synchronisation
            tasks.append(asyncio.create_task(one(session, i)))
        await asyncio.gather(*tasks)
    return accepted


def _warm_up(rig: Rig, api_url: str, label: str, log: Log) -> None:
    """One job of each priority through the new worker, under a tenant of its own: its
    consumer has its partitions before the measured jobs (whose deadlines are seconds)
    are submitted."""
    tenant_id, key = rig.tenant(f"bench-tiers-warm-{label}-{uuid.uuid4().hex[:6]}")
    for priority in ("interactive", "bulk"):
        body = json.dumps({"workflow": "summarize", "priority": priority,
                           "input": {"text": "warm up", "mode": "success"}}).encode()
        req = urllib.request.Request(f"{api_url}/v1/jobs", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {key}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10):
            pass
    wait(lambda: _ended(rig, tenant_id), 2, 120, "warm-up jobs", log)


def _ended(rig: Rig, tenant_id: str) -> int:
    return int(rig.query("SELECT count(*) FROM jobs WHERE tenant_id = %s AND status IN "
                         "('completed', 'dead_letter')", (tenant_id,))[0][0])


def _run(rig: Rig, api_url: str, fp_url: str, size: int, *, tiers: bool, log: Log,
         sampler: Sampler) -> dict[str, Any]:
    """One run of the workload; its figures."""
    label = "tiers" if tiers else "standard"
    tenant_id, key = rig.tenant(f"bench-tiers-{label}-{uuid.uuid4().hex[:6]}")
    _post(f"{fp_url}/admin/reset")
    env = {"CALMQ_FAKE_PROVIDER_URL": fp_url, "CALMQ_MODEL": MODEL,
           "CALMQ_SERVICE_TIERS": "flex,priority" if tiers else "",
           # The scaled stand-ins of 10 minutes of flex and 2.5 of standard, until measured.
           "CALMQ_SERVICE_TIER_FLEX_SECONDS": str(600 / TIME_SCALE),
           "CALMQ_SERVICE_TIER_STANDARD_SECONDS": str(150 / TIME_SCALE)}
    worker = f"worker:{label}"
    rig.calmq(worker, "--concurrency", str(CONCURRENCY), env=env)
    _warm_up(rig, api_url, label, log)
    phase = sampler.phase({**rig.pids(worker, "relay"), **rig.infra_pids()})
    accepted = asyncio.run(_submit(f"{api_url}/v1/jobs", key, size))
    wait(lambda: _ended(rig, tenant_id), accepted, 120 + max(c[2] for c in CLASSES),
         f"{label} jobs ended", log)
    sampler.end(phase)
    rig.stop(worker)
    figures = _figures(rig, tenant_id, accepted)
    stats = _get(f"{fp_url}/stats")
    figures["provider_calls_by_tier"] = stats.get("by_tier", {})
    figures["provider_flex_refused"] = int(stats.get("flex_refused", 0))
    figures["premium_calls"] = int(stats.get("by_tier", {}).get("priority", 0))
    log(f"  {label}: {accepted} jobs, cost {figures['cost_usd']:.6f} USD, deadlines met "
        f"{figures['deadlines_met']:.3f}, by tier {figures['provider_calls_by_tier']}")
    return figures


def _figures(rig: Rig, tenant_id: str, accepted: int) -> dict[str, Any]:
    rows = rig.query(
        """SELECT j.metadata ->> 'deadline_class', count(*), sum(j.cost_usd),
                  count(*) FILTER (WHERE j.status = 'completed' AND
                                   (j.deadline_at IS NULL OR j.updated_at <= j.deadline_at))
           FROM jobs j WHERE j.tenant_id = %s GROUP BY 1""", (tenant_id,))
    by_class = {name: {"jobs": int(n), "cost_usd": float(cost or 0), "met": int(met)}
                for name, n, cost, met in rows}
    # Why a deadline is missed: a job that waited past it before its step ran (the stack's
    # queueing: on a loaded machine, seconds, which the scaled deadlines do not scale), or
    # one whose call was late. The wait is submit to the first attempt's start.
    for name, p50, p99, wait_max, unstarted in rig.query(
            """SELECT j.metadata ->> 'deadline_class',
                      percentile_cont(0.5) WITHIN GROUP (ORDER BY s.wait),
                      percentile_cont(0.99) WITHIN GROUP (ORDER BY s.wait), max(s.wait),
                      count(*) FILTER (WHERE s.error_code = 'deadline_exceeded')
               FROM jobs j
               JOIN LATERAL (SELECT extract(epoch FROM a.started_at - j.created_at) AS wait,
                                    a.error_code
                             FROM job_attempts a WHERE a.job_id = j.id
                             ORDER BY a.started_at LIMIT 1) s ON true
               WHERE j.tenant_id = %s GROUP BY 1""", (tenant_id,)):
        if name in by_class:
            by_class[name].update({
                "start_wait_p50_ms": round(float(p50) * 1000, 1),
                "start_wait_p99_ms": round(float(p99) * 1000, 1),
                "start_wait_max_ms": round(float(wait_max) * 1000, 1),
                "missed_before_running": int(unstarted)})
    jobs = sum(c["jobs"] for c in by_class.values())
    met = sum(c["met"] for c in by_class.values())
    attempts = int(rig.query(
        "SELECT count(*) FROM job_attempts a JOIN jobs j ON j.id = a.job_id "
        "WHERE j.tenant_id = %s", (tenant_id,))[0][0])
    retries = int(rig.query(
        "SELECT count(*) FROM job_events e JOIN jobs j ON j.id = e.job_id "
        "WHERE j.tenant_id = %s AND e.type = 'retry_scheduled'", (tenant_id,))[0][0])
    calls: list[dict[str, Any]] = []
    for (entries,) in rig.query(
            "SELECT e.detail -> 'tiers' FROM job_events e JOIN jobs j ON j.id = e.job_id "
            "WHERE j.tenant_id = %s AND e.detail ? 'tiers'", (tenant_id,)):
        calls.extend(entries)
    refused = [c for c in calls if c.get("moved") == "flex_refused"]
    premium = [c for c in calls if c["chosen"] == "priority"]
    late = [c for c in calls if c.get("moved") == "flex_late"]
    return {"jobs": jobs, "jobs_accepted": accepted,
            "cost_usd": round(sum(c["cost_usd"] for c in by_class.values()), 6),
            "deadlines_met": round(met / jobs, 4) if jobs else 0.0,
            "deadlines_missed": jobs - met,
            "attempts": attempts, "attempts_beyond_one_a_job": attempts - jobs,
            "retries_scheduled": retries,
            "calls_chosen_flex": sum(c["chosen"] == "flex" for c in calls),
            "calls_served_flex": sum(c["served"] == "flex" for c in calls),
            "calls_chosen_priority": len(premium),
            # standard answers in STANDARD_MS: with four times that left it would have done
            "premium_calls_where_standard_would_do": sum(
                c.get("left_s", 0.0) >= 4 * STANDARD_MS / 1000 for c in premium),
            "flex_refusals_moved": len(refused),
            "flex_refusal_move_max_ms": max((c["moved_ms"] for c in refused), default=0.0),
            "flex_refusal_move_p50_ms": (sorted(c["moved_ms"] for c in refused)[
                len(refused) // 2] if refused else 0.0),
            "flex_refusals_moved_within_1s": sum(c["moved_ms"] < 1000 for c in refused),
            "flex_late_moved": len(late),
            # The machine's load as the run ended (the result's "machine" has it at start):
            # deadlines of seconds are missed by a loaded machine's queueing alone.
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "by_class": by_class}


def tiers(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    with Rig(log=log) as rig:
        fp = rig.calmq("fake-provider", "--latency-ms", str(STANDARD_MS), "--flex-latency-ms",
                       str(FLEX_MS), "--flex-refusal-rate", str(FLEX_REFUSAL))
        env = {"CALMQ_FAKE_PROVIDER_URL": fp.url}
        api = rig.calmq("api", env=env)
        rig.calmq("relay", env=env)
        log(f"  {size} jobs, a quarter each {', '.join(c[3] for c in CLASSES)}; time scaled "
            f"down {TIME_SCALE}x; flex refuses {FLEX_REFUSAL:.0%}")
        figures = _run(rig, api.url, fp.url, size, tiers=True, log=log, sampler=sampler)
        log("  baseline all_standard: the same workload, no tier sent")
        base = _run(rig, api.url, fp.url, size, tiers=False, log=log, sampler=sampler)
        versions = rig.versions
    figures["time_scale"] = (f"1/{TIME_SCALE}: deadlines " + ", ".join(
        f"{c[3]} -> {c[2]} s" for c in CLASSES) + f"; standard latency {STANDARD_MS} ms, "
        f"flex {FLEX_MS} ms")
    return result("tiers", size, figures, {"all_standard": base},
                  {"cost_vs_all_standard": ratio(figures["cost_usd"], base["cost_usd"])},
                  versions)
