"""The bulk scenario (issue 43): a backfill from one file through `calmq submit --file`
against single POST /v1/jobs accepts on the same stack, in the same run.

calmq: ``size`` jobs written to a JSON Lines file, sent by the public CLI (chunks of 1,000
through POST /v1/jobs/bulk, one transaction each, a checkpoint after each); the figure is
the jobs the API stored per second of the command's run. Baseline ``single_post``: the
accept scenario's client loop (ACCEPT_CONCURRENCY connections, each sending its next submit
as soon as it is answered) posting ``size`` single jobs to the same API, with the relay
draining the outbox during both. Target: bulk at least 5x the single-POST accept rate.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from typing import Any

from bench import loadgen
from bench.accept import ACCEPT_CONCURRENCY
from bench.common import Log, job_body, process_costs, ratio, rounded
from bench.loadgen import percentile
from bench.procs import LOADGEN, Sampler
from bench.report import result
from bench.rig import Rig

__all__ = ["DEFAULT_SIZE", "bulk"]

DEFAULT_SIZE = 40_000
CHUNK = 1000


def _stored(rig: Rig, tenant_id: str) -> int:
    return int(rig.query("SELECT count(*) FROM jobs WHERE tenant_id = %s", (tenant_id,))[0][0])


def bulk(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    with Rig(log=log) as rig:
        api = rig.calmq("api")
        rig.calmq("relay")  # accepts are measured with the outbox drained, as in production
        tag = uuid.uuid4().hex[:8]

        # calmq: the file through the CLI.
        tenant_id, key = rig.tenant(f"bench-bulk-{tag}")
        source = rig.dir / "backfill.jsonl"
        base = job_body()
        with source.open("w") as fh:
            for n in range(size):
                fh.write(json.dumps({**base, "metadata": {"backfill": tag, "n": n}}) + "\n")
        env = rig.child_env({"CALMQ_API_URL": api.url, "CALMQ_API_KEY": key})
        log(f"  calmq: {size} jobs from one file, `calmq submit --file` in chunks of {CHUNK}")
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        phase = sampler.phase({**rig.pids("api", "relay"), **rig.infra_pids()})
        started = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "calmq.cli", "submit", "--file", str(source), "--chunk-size",
             str(CHUNK), "-o", "json"], env=env, capture_output=True, text=True, check=False,
            timeout=3600)
        seconds = time.monotonic() - started
        sampler.end(phase)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cli_cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
        phase.cpu[LOADGEN] = phase.cpu.get(LOADGEN, 0.0) + cli_cpu
        if run.returncode != 0:
            raise RuntimeError(f"calmq submit --file exited {run.returncode}: "
                               f"{run.stderr[-2000:]}")
        summary = json.loads(run.stdout)
        stored = _stored(rig, tenant_id)
        figures = {"jobs_per_s": rounded(stored / seconds), "seconds": rounded(seconds, 2),
                   "accepted": summary["accepted"], "duplicate": summary["duplicate"],
                   "refused": summary["refused"], "jobs_stored": stored,
                   "chunk_size": CHUNK, "cli_cpu_s": rounded(cli_cpu, 2),
                   **process_costs(phase, ["api", "relay"], stored)}

        # Baseline: single POSTs, the accept scenario's loop, on the same API.
        single_id, single_key = rig.tenant(f"bench-single-{tag}")
        auth = {"Authorization": f"Bearer {single_key}"}
        url = f"{api.url}/v1/jobs"
        asyncio.run(loadgen.closed_loop(url, job_body(), auth, total=200,
                                        concurrency=ACCEPT_CONCURRENCY))
        log(f"  baseline single_post: {size} POST /v1/jobs from {ACCEPT_CONCURRENCY} "
            "connections")
        phase = sampler.phase({**rig.pids("api", "relay"), **rig.infra_pids(),
                               LOADGEN: os.getpid()})
        load = asyncio.run(loadgen.closed_loop(url, job_body(), auth, total=size,
                                               concurrency=ACCEPT_CONCURRENCY))
        sampler.end(phase)
        baseline = {"accepts_per_s": rounded(load.rate),
                    "p50_ms": rounded(percentile(load.latencies_ms, 50), 2),
                    "p99_ms": rounded(percentile(load.latencies_ms, 99), 2),
                    "errors": sum(load.errors.values()),
                    "jobs_stored": _stored(rig, single_id) - 200,
                    **process_costs(phase, ["api", "relay"], load.ok)}
        versions = rig.versions
    return result("bulk", size, figures, {"single_post": baseline},
                  {"jobs_per_s_vs_single_post": ratio(figures["jobs_per_s"], load.rate)},
                  versions, extra_versions={"load_generator": loadgen.NAME})
