"""The slow scenario: long model calls (fixed and log-normal latencies) with many in flight,
against a one-at-a-time consumer and the SKIP LOCKED queue."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from confluent_kafka import Producer

from bench import loadgen
from bench.common import (
    E2E_CONCURRENCY,
    PY,
    Log,
    calmq_span,
    completed,
    create_topic,
    high_watermark,
    job_body,
    oneshot,
    process_costs,
    ratio,
    rounded,
    skip_locked_drain,
    wait,
)
from bench.procs import Sampler
from bench.report import result
from bench.rig import Rig

SLOW_LATENCY_MS = 2000
# The same 2 s mean as SLOW_LATENCY_MS, spread like real calls (p99 5x the median, the shape
# of longcalls' 8 s / 40 s): 1,000 in flight then allow the same 500 jobs/s, without waves.
SLOW_LATENCY_DIST = "lognormal:median=1574ms,p99=7872ms"
SLOW_IN_FLIGHT = 1000
SERIAL_SAMPLE = 5  # a one-at-a-time consumer needs 2 s a job: a sample, not 10,000


# -- slow -------------------------------------------------------------------------------------

def _steady_rate(rig: Rig, tenant_id: str, settle_s: float) -> float:
    """Completions per second from the first claim + ``settle_s`` (the first calls' p99:
    they have ended, or nearly) to the last claim (until then every freed slot had a job):
    the rate a worker sustains, without the start-up and the tail of the last calls, which
    spread latencies stretch. 0 when that window is under 5 s (too few jobs)."""
    rows = rig.query(
        """SELECT e.type, extract(epoch FROM e.at) FROM job_events e JOIN jobs j
           ON j.id = e.job_id WHERE j.tenant_id = %s AND e.type IN ('running', 'completed')""",
        (tenant_id,))
    running = [float(t) for k, t in rows if k == "running"]
    if not running:
        return 0.0
    w0, w1 = min(running) + settle_s, max(running)
    if w1 - w0 < 5:
        return 0.0
    done = sum(1 for k, t in rows if k == "completed" and w0 <= float(t) <= w1)
    return rounded(done / (w1 - w0))


def _slow_pass(rig: Rig, fp: str, size: int, latency: str, sampler: Sampler,
               log: Log, *, p99_s: float) -> dict[str, Any]:
    """``size`` jobs queued on the one partition, then one worker with 1,000 slots drains
    them against the fake provider ``fp``; the api and relay are stopped afterwards."""
    env = {"CALMQ_FAKE_PROVIDER_URL": rig.procs[fp].url}
    api = rig.calmq("api", env=env)
    rig.calmq("relay", env=env)
    tenant_id, key = rig.tenant(f"bench-slow-{uuid.uuid4().hex[:6]}")
    topic = "calmq.default.bulk"
    before = high_watermark(rig.bootstrap, topic)
    log(f"  calmq: {size} jobs queued on one partition, provider latency {latency}")
    load = asyncio.run(loadgen.closed_loop(f"{api.url}/v1/jobs", job_body(),
                                           {"Authorization": f"Bearer {key}"}, total=size,
                                           concurrency=E2E_CONCURRENCY))
    rig.stop("api")
    wait(lambda: high_watermark(rig.bootstrap, topic) - before, load.ok, 120, "relay", log)
    log(f"  calmq: worker with --concurrency {SLOW_IN_FLIGHT} drains them")
    phase = sampler.phase({**rig.pids("relay", fp), **rig.infra_pids()})
    worker = rig.calmq("worker", "--concurrency", str(SLOW_IN_FLIGHT), env=env)
    phase.pids["worker"] = worker.pid
    wait(lambda: completed(rig, tenant_id), load.ok,
          120 + load.ok * SLOW_LATENCY_MS / 1000 / 100, "slow jobs", log)
    sampler.end(phase)
    done, first, last = calmq_span(rig, tenant_id)
    rig.stop("worker")
    rig.stop("relay")
    return {"jobs_per_s": rounded(done / max(last - first, 1e-3)), "completed": done,
            "jobs_per_s_steady": _steady_rate(rig, tenant_id, p99_s),
            **process_costs(phase, ["worker", "relay"], done)}


def slow(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    from calmq.tooling.latency import parse_latency

    spread = parse_latency(SLOW_LATENCY_DIST)
    with Rig(partitions=1, log=log) as rig:
        fp = rig.calmq("fake-provider", "--latency-ms", str(SLOW_LATENCY_MS))
        env = {"CALMQ_FAKE_PROVIDER_URL": fp.url}
        fixed = _slow_pass(rig, "fake-provider", size, f"fixed {SLOW_LATENCY_MS} ms", sampler,
                           log, p99_s=SLOW_LATENCY_MS / 1000)
        rig.calmq("fake-provider:lognormal", "--latency-dist", SLOW_LATENCY_DIST)
        lognormal = _slow_pass(rig, "fake-provider:lognormal", size, spread.describe(),
                               sampler, log, p99_s=spread.p99)
        rig.stop("fake-provider:lognormal")
        figures = {**fixed, "in_flight": SLOW_IN_FLIGHT, "partitions": 1,
                   "provider_latency_ms": SLOW_LATENCY_MS,
                   # The same worker and mean latency with calls that do not end in waves.
                   "jobs_per_s_lognormal": lognormal["jobs_per_s"],
                   # jobs/s above runs to the last completion, which the tail stretches.
                   "jobs_per_s_lognormal_steady": lognormal["jobs_per_s_steady"],
                   "completed_lognormal": lognormal["completed"],
                   "cpu_s_per_1000_jobs_lognormal": lognormal["cpu_s_per_1000_jobs"],
                   "peak_rss_mb_lognormal": lognormal["peak_rss_mb"],
                   "provider_latency_lognormal": spread.describe(),
                   "ideal_jobs_per_s": rounded(SLOW_IN_FLIGHT / (SLOW_LATENCY_MS / 1000))}

        skip = skip_locked_drain(rig, size, env, sampler, log, workers=SLOW_IN_FLIGHT,
                                  pool_size=32,
                                  timeout=60 + size * SLOW_LATENCY_MS / 1000 / 100)

        create_topic(rig.bootstrap, "bench.serial", 1)
        from bench.raw_kafka import encoded_events

        producer = Producer({"bootstrap.servers": rig.bootstrap})
        for k, v in encoded_events(SERIAL_SAMPLE, rig.env.get("CALMQ_SCHEMA_REGISTRY_URL", "")):
            producer.produce("bench.serial", value=v, key=k)
        producer.flush(30)
        del producer  # its threads must not outlive the broker
        log(f"  baseline serial: a one-at-a-time consumer, {SERIAL_SAMPLE} jobs "
            f"(~{SERIAL_SAMPLE * SLOW_LATENCY_MS / 1000:.0f} s)")
        ser, cpu, rss = oneshot(rig, "serial", [PY, "-m", "bench.serial", "--topic",
                                                 "bench.serial", "--count", str(SERIAL_SAMPLE)],
                                 env=env)
        serial_cpu = rounded(float(ser.get("cpu_s", cpu)) * 1000 / max(ser["count"], 1), 3)
        serial = {"jobs_per_s": ser["jobs_per_s"], "completed": ser["count"],
                  "peak_rss_mb": rounded(rss), "cpu_s_per_1000_jobs": serial_cpu,
                  "cpu_s_per_1000_jobs_own": serial_cpu}
        versions = rig.versions
    return result("slow", size, figures, {"serial": serial, "skip_locked": skip},
                  {"jobs_per_s_vs_serial": ratio(figures["jobs_per_s"], serial["jobs_per_s"]),
                   "jobs_per_s_vs_skip_locked": ratio(figures["jobs_per_s"], skip["jobs_per_s"])},
                  versions, extra_versions={"load_generator": loadgen.NAME})
