"""``calmq bench batch``: a backfill through the batch lane while interactive work runs online.

Three phases on one throwaway stack:

1. interactive jobs alone, online at a steady rate: accept→dispatch p99 without a backfill;
2. ``size`` bulk jobs submitted with ``"lane": "batch"`` (the fake provider's batches end
   ``BATCH_DELAY_S`` after they are created) while the same interactive rate runs: the
   batch lane's rate (its span minus the provider's delay), its cost against the online
   cost of the same tokens, and the interactive dispatch p99 during the backfill;
3. a poller alone (``calmq batcher --poll-only``) collecting a synthetic batch whose results
   file is ``RESULTS_MB`` MB: its peak RSS (results are streamed, never held whole).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from bench import loadgen
from bench.procs import Phase, Sampler
from bench.report import result
from bench.rig import Rig

__all__ = ["batch"]

BATCH_DELAY_S = 5.0
INTERACTIVE_RATE = 10.0
INTERACTIVE_SECONDS = 15.0
RESULTS_MB = 100
_LINE_BYTES = 1000


def _body(lane: str, priority: str) -> dict[str, Any]:
    return {"workflow": "summarize", "priority": priority, "lane": lane,
            "input": {"text": "Yesterday's ticket: the printer is on fire again.",
                      "mode": "success"}}


def _count(rig: Rig, tenant_id: str, status: str) -> int:
    return int(rig.query("SELECT count(*) FROM jobs WHERE tenant_id = %s AND status = %s",
                         (tenant_id, status))[0][0])


def _wait(check: Any, target: int, timeout: float, what: str, log: Any) -> int:
    deadline = time.monotonic() + timeout
    value = check()
    while value < target and time.monotonic() < deadline:
        time.sleep(0.2)  # a polling interval under a deadline
        value = check()
    if value < target:
        log(f"  {what}: only {value} of {target} within {timeout:.0f} s")
    return int(value)


def _dispatch_p99(rig: Rig, tenant_id: str) -> float:
    rows = rig.query(
        """SELECT extract(epoch FROM min(r.at) - q.at) * 1000
           FROM jobs j JOIN job_events q ON q.job_id = j.id AND q.type = 'queued'
                       JOIN job_events r ON r.job_id = j.id AND r.type = 'running'
           WHERE j.tenant_id = %s GROUP BY j.id, q.at""", (tenant_id,))
    return round(loadgen.percentile([float(r[0]) for r in rows], 99), 2)


def _interactive(rig: Rig, url: str, log: Any, label: str) -> tuple[str, Any]:
    tenant_id, key = rig.tenant(f"bench-batch-{label}-{uuid.uuid4().hex[:6]}")
    load = loadgen.open_loop(url, _body("online", "interactive"),
                             {"Authorization": f"Bearer {key}"}, rate=INTERACTIVE_RATE,
                             seconds=INTERACTIVE_SECONDS)
    return tenant_id, load


def _poller_rss(rig: Rig, fp_url: str, env: dict[str, str], sampler: Sampler,
                log: Any) -> dict[str, float]:
    import json
    import urllib.request

    lines = RESULTS_MB * 1024 * 1024 // _LINE_BYTES
    req = urllib.request.Request(f"{fp_url}/admin/batches/synthetic", method="POST",
                                 data=json.dumps({"lines": lines, "pad": _LINE_BYTES}).encode())
    with urllib.request.urlopen(req, timeout=300) as resp:
        made = json.loads(resp.read())
    key = uuid.uuid4()
    # The batch as a batcher would have recorded it: submitted, due for a poll now.
    rig.query("INSERT INTO provider_batches (key, provider, model, endpoint, pool, provider_id, "
              "state, request_count, submitted_at) VALUES (%s, 'openai', 'fake-small', "
              "'/v1/chat/completions', 'default', %s, 'submitted', %s, now()) RETURNING key",
              (key, made["id"], lines))
    log(f"  poller alone: a {made['bytes'] / 1e6:.0f} MB results file ({lines} lines)")
    proc = rig.calmq("batcher:poller", "--poll-only", env=env)
    phase = sampler.phase({"poller": proc.pid})
    started = time.monotonic()
    _wait(lambda: int(rig.query("SELECT count(*) FROM provider_batches WHERE key = %s AND "
                                "state = 'collected'", (key,))[0][0]), 1, 600,
          "the synthetic batch collected", log)
    seconds = time.monotonic() - started
    sampler.end(phase)
    rig.stop("batcher:poller")
    return {"poller_peak_rss_mb": round(phase.peak_rss_mb.get("poller", 0.0), 1),
            "results_file_mb": round(made["bytes"] / 1e6, 1),
            "poller_stream_seconds": round(seconds, 1)}


def batch(size: int, log: Any, sampler: Sampler, **_: Any) -> dict[str, Any]:
    with Rig(log=log) as rig:
        fp = rig.calmq("fake-provider", "--batch-completion-seconds", str(BATCH_DELAY_S))
        env = {"CALMQ_FAKE_PROVIDER_URL": fp.url, "CALMQ_BATCH_MAX_AGE_SECONDS": "2",
               "CALMQ_BATCH_POLL_INTERVAL_SECONDS": "1", "CALMQ_BATCH_MAX_REQUESTS": "5000"}
        api = rig.calmq("api", env=env)
        rig.calmq("relay", env=env)
        rig.calmq("forwarder", env=env)
        rig.calmq("worker", env=env)
        url = f"{api.url}/v1/jobs"

        log(f"  interactive alone: {INTERACTIVE_RATE:.0f} jobs/s for {INTERACTIVE_SECONDS:.0f} s")
        alone_id, alone = _interactive(rig, url, log, "alone")
        asyncio.run(alone)
        _wait(lambda: _count(rig, alone_id, "completed"), int(INTERACTIVE_RATE *
              INTERACTIVE_SECONDS), 120, "interactive jobs", log)
        p99_alone = _dispatch_p99(rig, alone_id)

        rig.calmq("batcher", env=env)
        bulk_id, bulk_key = rig.tenant(f"bench-batch-bulk-{uuid.uuid4().hex[:6]}")
        busy_id, busy_key = rig.tenant(f"bench-batch-busy-{uuid.uuid4().hex[:6]}")
        log(f"  backfill: {size} batch-lane jobs while interactive jobs run online")
        phase: Phase = sampler.phase({**rig.pids("batcher", "worker"), **rig.infra_pids()})
        started = time.time()

        async def both() -> Any:
            backfill = loadgen.closed_loop(url, _body("batch", "bulk"),
                                           {"Authorization": f"Bearer {bulk_key}"},
                                           total=size, concurrency=32)
            interactive = loadgen.open_loop(url, _body("online", "interactive"),
                                            {"Authorization": f"Bearer {busy_key}"},
                                            rate=INTERACTIVE_RATE, seconds=INTERACTIVE_SECONDS)
            return await asyncio.gather(backfill, interactive)

        accepted, _busy = asyncio.run(both())
        done = _wait(lambda: _count(rig, bulk_id, "completed"), accepted.ok,
                     120 + size / 20, "batch-lane jobs", log)
        sampler.end(phase)
        p99_busy = _dispatch_p99(rig, busy_id)
        span = float(rig.query(
            "SELECT extract(epoch FROM max(updated_at)) FROM jobs WHERE tenant_id = %s "
            "AND status = 'completed'", (bulk_id,))[0][0] or started) - started
        rounds = int(rig.query(
            "SELECT count(DISTINCT b.key) FROM provider_batches b JOIN batch_jobs bj "
            "ON bj.batch_key = b.key JOIN jobs j ON j.id = bj.job_id WHERE j.tenant_id = %s",
            (bulk_id,))[0][0])
        cost, online = (float(v or 0) for v in rig.query(
            "SELECT sum(bj.cost_usd), sum(bj.online_cost_usd) FROM batch_jobs bj JOIN jobs j "
            "ON j.id = bj.job_id WHERE j.tenant_id = %s", (bulk_id,))[0])
        rig.stop("batcher")
        rss = _poller_rss(rig, fp.url, env, sampler, log)
        versions = rig.versions
    # The provider's delay overlaps across batches created together; at least one window
    # of it is in every backfill's span, and it is the provider's, not calmq's.
    figures = {
        "jobs_per_s": round(done / max(span - BATCH_DELAY_S, 1e-3), 1),
        "jobs_per_s_with_provider_delay": round(done / max(span, 1e-3), 1),
        "completed": done, "provider_batches": rounds,
        "provider_delay_s": BATCH_DELAY_S,
        "cost_usd": round(cost, 6), "online_equivalent_usd": round(online, 6),
        "cost_ratio_vs_online": round(cost / online, 3) if online else 0.0,
        "interactive_dispatch_p99_ms": p99_busy,
        "interactive_dispatch_p99_ms_without_backfill": p99_alone,
        "interactive_rate": INTERACTIVE_RATE,
        "batcher_peak_rss_mb": round(phase.peak_rss_mb.get("batcher", 0.0), 1),
        **rss,
    }
    return result("batch", size, figures, {}, {
        "interactive_dispatch_p99_vs_without_backfill": round(
            p99_busy / p99_alone, 2) if p99_alone else 0.0}, versions)
