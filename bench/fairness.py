"""``calmq bench fairness``: one tenant's jobs behind another tenant's backlog, in one lane.

Issue 31's scenario on the default stack (one worker, 256 call slots, fair share on as by
default; ``BENCH_FAIR_SHARE=0`` measures it off), against a fake provider whose calls take 2 s:

- **alone**: a small tenant submits 2 bulk jobs a second for a minute: its turnaround
  (queued -> completed) p50/p99. Then a big tenant's bulk jobs alone: its throughput
  (jobs completed a second in the minute after its submit ended, the window behind uses).
- **behind**: the big tenant submits ``size`` bulk jobs (12,000 by default: about 95 s of
  the worker's slots), then the small tenant the same minute of jobs: the small tenant's
  p50/p99 against alone, and the big tenant's throughput meanwhile against alone.
- **weights**: five busy tenants of weights 1, 1, 1, 2 and 5 (backlogs in proportion, so all
  five stay busy together): each one's share of the attempts started while all five wait,
  against its weight's share.

- **cooldown**: a tenant submits jobs of a workflow whose step allows ``fake-small`` then
  ``fake-large`` (bench/fallback_workflows.py) at a steady rate; a while in, the fake
  provider answers every ``fake-small`` call with 429 and ``retry-after: 30``. Figures: the
  share of calls to the cooling model inside the 30 s window after the first 429 (target
  <= 1 %), the attempts burned (attempts past the first, and failed attempt rows: target
  0) and the time from the first 429's answer to the first ``fake-large`` call (target
  <= 1 s). The 429's answer time is its arrival plus the fake provider's latency (it answers
  an outage's calls after its latency, like every call).

Without fair share the small tenant's jobs wait behind the backlog in Kafka's order (p99
74.7 s against 2.28 s alone, the issue's measure).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from typing import Any

from bench import fallback_workflows, loadgen
from bench.common import wait
from bench.loadgen import percentile
from bench.priority import turnaround_ms
from bench.procs import Sampler
from bench.report import result
from bench.rig import Rig

__all__ = ["DEFAULT_SIZE", "fairness"]

DEFAULT_SIZE = 12_000
CALL_MS = 2000
SMALL_RATE = 2.0
SMALL_SECONDS = 60.0
# The big tenant alone: enough jobs to keep the slots full for the small tenant's minute
# after the submit ends (~78 s of the slots), so its throughput is read over the same window
# as behind the backlog. A window of ~15 s read it 119 to 133 jobs/s: 256 calls started
# together end together, every 2 s, and one wave more or less in a short window is +-8 %.
ALONE_BIG = 10_000
WEIGHTS = (1, 1, 1, 2, 5)
WEIGHTED_JOBS = 10_000  # split by weight: all five stay busy for ~75 s
COOLDOWN_RATE = 20.0  # jobs a second of the cooldown run
COOLDOWN_SECONDS = 60.0
COOLDOWN_AFTER = 10.0  # seconds into the run when the first model starts answering 429
RETRY_AFTER = 30.0

Log = Any


def _body(text: str) -> dict[str, Any]:
    return {"workflow": "summarize", "priority": "bulk",
            "input": {"text": text, "mode": "success"}}


def _count(rig: Rig, tenant_id: str, status: str = "completed") -> int:
    return int(rig.query("SELECT count(*) FROM jobs WHERE tenant_id = %s AND status = %s",
                         (tenant_id, status))[0][0])


def _completed_between(rig: Rig, tenant_id: str, t0: float, t1: float) -> int:
    return int(rig.query(
        """SELECT count(*) FROM jobs j JOIN job_events c ON c.job_id = j.id
           WHERE j.tenant_id = %s AND c.type = 'completed'
             AND c.at BETWEEN to_timestamp(%s) AND to_timestamp(%s)""",
        (tenant_id, t0, t1))[0][0])


def _started_between(rig: Rig, tenants: list[str], t0: float, t1: float) -> dict[str, int]:
    rows = rig.query(
        """SELECT j.tenant_id::text, count(*) FROM job_attempts a JOIN jobs j ON j.id = a.job_id
           WHERE j.tenant_id = ANY(%s::uuid[])
             AND a.started_at BETWEEN to_timestamp(%s) AND to_timestamp(%s)
           GROUP BY j.tenant_id""", (tenants, t0, t1))
    return {str(t): int(n) for t, n in rows}


def _submit(url: str, key: str, total: int, text: str) -> loadgen.LoadResult:
    return asyncio.run(loadgen.closed_loop(url, _body(text), {"Authorization": f"Bearer {key}"},
                                           total=total, concurrency=32))


def _small_minute(rig: Rig, url: str, label: str, seconds: float, log: Log
                  ) -> tuple[str, dict[str, float], float, float]:
    tenant_id, key = rig.tenant(f"bench-small-{label}-{uuid.uuid4().hex[:6]}")
    log(f"  calmq: small tenant at {SMALL_RATE:.0f} jobs/s for {seconds:.0f} s ({label})")
    t0 = time.time()
    load = asyncio.run(loadgen.open_loop(url, _body(f"small tenant {label}"),
                                         {"Authorization": f"Bearer {key}"},
                                         rate=SMALL_RATE, seconds=seconds))
    t1 = time.time()
    done = wait(lambda: _count(rig, tenant_id), load.ok, 120, f"small tenant ({label})", log)
    lat = turnaround_ms(rig, tenant_id)
    return tenant_id, {"small_p50_ms": round(percentile(lat, 50), 1),
                       "small_p99_ms": round(percentile(lat, 99), 1),
                       "small_completed": done, "small_submitted": load.ok}, t0, t1


def _set_weight(rig: Rig, name: str, weight: float) -> None:
    subprocess.run([sys.executable, "-m", "calmq.cli", "tenants", "set-weight", name,
                    "--weight", str(weight)], env=rig.child_env(), check=True,
                   capture_output=True, timeout=60)


def _weighted(rig: Rig, url: str, log: Log, scale: float) -> dict[str, Any]:
    """Five busy tenants: each one's share of the attempts started while all five wait."""
    total_weight = sum(WEIGHTS)
    tenants: list[tuple[str, int, int]] = []  # (id, weight, jobs)
    keys: list[str] = []
    for i, weight in enumerate(WEIGHTS):
        name = f"bench-weight{weight}-{i}-{uuid.uuid4().hex[:6]}"
        tenant_id, key = rig.tenant(name)
        _set_weight(rig, name, weight)
        jobs = max(50, round(WEIGHTED_JOBS * scale * weight / total_weight))
        tenants.append((tenant_id, weight, jobs))
        keys.append(key)
    log(f"  calmq: five tenants of weights {WEIGHTS} submit "
        f"{sum(j for _t, _w, j in tenants)} jobs")
    t0 = time.time()
    for (_tenant, weight, jobs), key in zip(tenants, keys, strict=True):
        _submit(url, key, jobs, f"weight {weight} tenant")
    submitted = time.time()
    ids = [t for t, _w, _j in tenants]

    def all_waiting() -> bool:
        rows = rig.query("""SELECT count(DISTINCT tenant_id) FROM jobs
                            WHERE tenant_id = ANY(%s::uuid[]) AND status = 'queued'""", (ids,))
        return int(rows[0][0]) == len(ids)

    # The window: from the last submit until the first tenant has nothing left waiting.
    start = submitted
    end = start
    deadline = time.monotonic() + 600
    while all_waiting() and time.monotonic() < deadline:
        time.sleep(0.5)  # a polling interval under a deadline
        end = time.time()
    started = _started_between(rig, ids, start, end)
    attempts = sum(started.values())
    shares = []
    for tenant_id, weight, jobs in tenants:
        got = started.get(tenant_id, 0) / attempts if attempts else 0.0
        want = weight / total_weight
        shares.append({"weight": weight, "jobs": jobs, "share": round(got, 4),
                       "weight_share": round(want, 4),
                       "share_vs_weight": round(got / want, 3) if want else 0.0})
    wait(lambda: sum(_count(rig, t) for t in ids), sum(j for _t, _w, j in tenants), 900,
          "the weighted tenants' jobs", log)
    return {"window_s": round(end - start, 1), "attempts_in_window": attempts,
            "submit_s": round(submitted - t0, 1), "tenants": shares,
            "worst_share_vs_weight": max((abs(s["share_vs_weight"] - 1) for s in shares),
                                         default=0.0)}


def _admin(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        f"{url}{path}", method="POST" if body is not None else "GET",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)


def _cooldown(rig: Rig, url: str, provider: str, log: Log, scale: float) -> dict[str, Any]:
    """A steady load on a two-model step while its first model answers 429 for a while."""
    tenant_id, key = rig.tenant(f"bench-cooldown-{uuid.uuid4().hex[:6]}")
    seconds = max(30.0, COOLDOWN_SECONDS * scale)
    outage = {"seconds": seconds, "statuses": [429], "model": fallback_workflows.FIRST,
              "retry_after_seconds": RETRY_AFTER}
    log(f"  calmq: cooldown run, {COOLDOWN_RATE:.0f} jobs/s for {seconds:.0f} s; "
        f"{fallback_workflows.FIRST} answers 429 (retry-after {RETRY_AFTER:.0f} s) from "
        f"{COOLDOWN_AFTER:.0f} s on")
    began: list[float] = []

    def start_outage() -> None:
        began.append(time.time())  # every call to the first model from now meets the 429
        _admin(provider, "/admin/outage", outage)

    timer = threading.Timer(COOLDOWN_AFTER, start_outage)
    timer.start()
    body = {"workflow": fallback_workflows.WORKFLOW, "priority": "bulk",
            "input": {"text": "cooldown run", "mode": "success"}}
    try:
        load = asyncio.run(loadgen.open_loop(url, body, {"Authorization": f"Bearer {key}"},
                                             rate=COOLDOWN_RATE, seconds=seconds))
    finally:
        timer.join()
    wait(lambda: _count(rig, tenant_id), load.ok, 300, "the cooldown run's jobs", log)
    jobs = {str(r[0]) for r in rig.query("SELECT id FROM jobs WHERE tenant_id = %s",
                                         (tenant_id,))}
    calls = [c for c in _admin(provider, "/admin/calls")["calls"] if c["job"] in jobs]
    latency = CALL_MS / 1000
    # The calls to the first model that met the outage; the first 429 is the first one's
    # answer, after the latency.
    hit = sorted(c["at"] for c in calls
                 if c["model"] == fallback_workflows.FIRST and began and c["at"] >= began[0])
    figures: dict[str, Any] = {"jobs": load.ok, "calls": len(calls),
                               "retry_after_s": RETRY_AFTER, "call_ms": CALL_MS}
    if hit:
        t429 = hit[0] + latency
        window = [c for c in calls if t429 <= c["at"] < t429 + RETRY_AFTER]
        cooling = [c for c in window if c["model"] == fallback_workflows.FIRST]
        fallback = sorted(c["at"] for c in calls
                          if c["model"] == fallback_workflows.SECOND and c["at"] >= hit[0])
        figures.update({
            "calls_in_window": len(window), "cooling_calls_in_window": len(cooling),
            "cooling_call_share": round(len(cooling) / len(window), 4) if window else 0.0,
            "calls_met_429": len(hit),
            "first_fallback_s": round(fallback[0] - t429, 3) if fallback else None})
    burned = rig.query(
        """SELECT coalesce(sum(j.attempt - 1), 0),
                  (SELECT count(*) FROM job_attempts a JOIN jobs k ON k.id = a.job_id
                   WHERE k.tenant_id = %s AND a.error_code IS NOT NULL)
           FROM jobs j WHERE j.tenant_id = %s""", (tenant_id, tenant_id))[0]
    served = dict(rig.query(
        """SELECT a.model, count(*) FROM job_attempts a JOIN jobs j ON j.id = a.job_id
           WHERE j.tenant_id = %s GROUP BY 1""", (tenant_id,)))
    figures.update({"attempts_burned": int(burned[0]) + int(burned[1]),
                    "served_by_model": {str(k): int(v) for k, v in served.items()}})
    return figures


def fairness(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    scale = min(1.0, size / DEFAULT_SIZE)  # a smoke run shortens every phase in proportion
    seconds = max(10.0, SMALL_SECONDS * scale)
    with Rig(log=log) as rig:
        fp = rig.calmq("fake-provider", "--latency-ms", str(CALL_MS))
        env = {"CALMQ_FAKE_PROVIDER_URL": fp.url,
               "CALMQ_WORKFLOW_MODULES": "bench.fallback_workflows"}
        api = rig.calmq("api", env=env)
        rig.calmq("relay", env=env)
        rig.calmq("worker", env=env)
        url = f"{api.url}/v1/jobs"
        warm_id, key = rig.tenant(f"bench-warm-{uuid.uuid4().hex[:6]}")
        _submit(url, key, 40, "warm-up")
        wait(lambda: _count(rig, warm_id), 40, 60, "warm-up jobs", log)

        _small_alone, alone, _a0, _a1 = _small_minute(rig, url, "alone", seconds, log)

        big_alone_id, key = rig.tenant(f"bench-big-alone-{uuid.uuid4().hex[:6]}")
        n_alone = max(600, round(ALONE_BIG * scale))
        log(f"  calmq: big tenant alone, {n_alone} jobs")
        _submit(url, key, n_alone, "big tenant alone")
        # The window the small tenant's minute would take: from the submit's end, as behind.
        b0 = time.time()
        b1 = b0 + seconds
        while time.time() < b1:  # a measuring window of fixed length, not a wait for state
            time.sleep(0.5)
        big_alone = _completed_between(rig, big_alone_id, b0, b1) / max(b1 - b0, 1e-3)
        if _count(rig, big_alone_id) >= n_alone:
            log("  warning: the big tenant's jobs ran out before its window ended")
        wait(lambda: _count(rig, big_alone_id), n_alone, 300, "big tenant alone, all", log)

        big_id, key = rig.tenant(f"bench-big-{uuid.uuid4().hex[:6]}")
        log(f"  calmq: big tenant's backlog of {size} jobs")
        backlog = _submit(url, key, size, "big tenant backlog")
        _small_behind, behind, s0, s1 = _small_minute(rig, url, "behind", seconds, log)
        big_behind = _completed_between(rig, big_id, s0, s1) / max(s1 - s0, 1e-3)
        left = backlog.ok - _count(rig, big_id)
        if left <= 0:
            log("  warning: the backlog ran out before the small tenant's minute ended")
        wait(lambda: _count(rig, big_id), backlog.ok, 900, "the backlog", log)

        weighted = _weighted(rig, url, log, scale)
        cooldown = _cooldown(rig, url, fp.url, log, scale)
        versions = rig.versions
    figures: dict[str, Any] = {
        **behind, "big_jobs_per_s": round(big_behind, 1), "backlog": backlog.ok,
        "backlog_left_at_end": max(0, left), "call_ms": CALL_MS, "small_rate": SMALL_RATE,
        "small_seconds": seconds, "weighted": weighted, "cooldown": cooldown}
    baselines = {"alone": {**alone, "big_jobs_per_s": round(big_alone, 1)}}
    ratios = {
        "small_p99_vs_alone": round(behind["small_p99_ms"] / alone["small_p99_ms"], 3)
        if alone["small_p99_ms"] else 0.0,
        "small_p50_vs_alone": round(behind["small_p50_ms"] / alone["small_p50_ms"], 3)
        if alone["small_p50_ms"] else 0.0,
        "big_throughput_vs_alone": round(big_behind / big_alone, 3) if big_alone else 0.0,
        "worst_weighted_share_vs_weight": weighted["worst_share_vs_weight"],
    }
    return result("fairness", size, figures, baselines, ratios, versions,
                  extra_versions={"load_generator": loadgen.NAME})
