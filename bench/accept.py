"""The accept scenario: group-committed submits through the API against a bare INSERT
baseline."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

from bench import loadgen, wrk
from bench.common import (
    PY,
    Log,
    job_body,
    process_costs,
    ratio,
    rounded,
    skip_locked_schema,
)
from bench.loadgen import LoadResult, percentile
from bench.procs import LOADGEN, Phase, Sampler
from bench.report import result
from bench.rig import Rig

ACCEPT_CONCURRENCY = 32


# -- accept -----------------------------------------------------------------------------------

def _accept_load(url: str, auth: dict[str, str], size: int) -> LoadResult:
    """The measured submits: wrk for ``size`` / 400 seconds when installed, else ``size``
    POSTs from the in-process generator."""
    if wrk.available():
        return wrk.run(url, job_body(), auth, connections=ACCEPT_CONCURRENCY,
                       seconds=max(5.0, size / 400))
    return asyncio.run(loadgen.closed_loop(url, job_body(), auth, total=size,
                                           concurrency=ACCEPT_CONCURRENCY))


def _accept_figures(load: LoadResult, phase: Phase) -> dict[str, Any]:
    if isinstance(load, wrk.WrkResult):
        p50, p99 = load.p50_ms, load.p99_ms
        phase.cpu[LOADGEN] = phase.cpu.get(LOADGEN, 0.0) + load.cpu_s
    else:
        p50, p99 = percentile(load.latencies_ms, 50), percentile(load.latencies_ms, 99)
    return {"accepts_per_s": rounded(load.rate), "p50_ms": rounded(p50, 2),
            "p99_ms": rounded(p99, 2), "errors": sum(load.errors.values())}


def accept(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    generator = wrk.version() or loadgen.NAME
    with Rig(log=log) as rig:
        api = rig.calmq("api")
        # Accepts are measured with the relay draining the outbox, as in production.
        rig.calmq("relay")
        tenant_id, key = rig.tenant(f"bench-accept-{uuid.uuid4().hex[:6]}")
        auth = {"Authorization": f"Bearer {key}"}
        url = f"{api.url}/v1/jobs"
        asyncio.run(loadgen.closed_loop(url, job_body(), auth, total=200,
                                        concurrency=ACCEPT_CONCURRENCY))
        log(f"  calmq: POST /v1/jobs from {ACCEPT_CONCURRENCY} connections ({generator})")
        phase = sampler.phase({**rig.pids("api", "relay"), **rig.infra_pids(),
                               LOADGEN: os.getpid()})
        load = _accept_load(url, auth, size)
        sampler.end(phase)
        # Every 202 is a job in the database (the warm-up's 200 included).
        stored = int(rig.query("SELECT count(*) FROM jobs WHERE tenant_id = %s",
                               (tenant_id,))[0][0]) - 200
        figures = {**_accept_figures(load, phase), "accepted": load.ok, "jobs_stored": stored,
                   "connections": ACCEPT_CONCURRENCY,
                   **process_costs(phase, ["api", "relay"], load.ok)}
        rig.stop("api")

        skip_locked_schema(rig)
        base = rig.start("plain_insert", [PY, "-m", "bench.skip_locked", "serve", "--port",
                                          "{port}"], health="http")
        burl = f"{base.url}/jobs"
        asyncio.run(loadgen.closed_loop(burl, job_body(), {}, total=200,
                                        concurrency=ACCEPT_CONCURRENCY))
        log(f"  baseline plain_insert: POST /jobs ({generator})")
        phase = sampler.phase({**rig.pids("plain_insert"), **rig.infra_pids(),
                               LOADGEN: os.getpid()})
        bload = _accept_load(burl, {}, size)
        sampler.end(phase)
        baseline = {**_accept_figures(bload, phase),
                    **process_costs(phase, ["plain_insert"], bload.ok)}
        versions = rig.versions
    return result("accept", size, figures, {"plain_insert": baseline},
                  {"accepts_per_s_vs_plain_insert": ratio(load.rate, bload.rate)},
                  versions, extra_versions={"load_generator": generator})
