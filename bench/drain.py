"""The drain scenario: a backlog of jobs drained by the workers, against SKIP LOCKED."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.common import (
    E2E_CONCURRENCY,
    Log,
    calmq_span,
    completed,
    hot_share,
    job_body,
    pg_ratio,
    process_costs,
    ratio,
    rounded,
    skip_locked_drain,
    wait,
    write_statements,
)
from bench.procs import Sampler
from bench.report import result
from bench.rig import Rig

# -- drain ------------------------------------------------------------------------------------

def drain(size: int, log: Log, sampler: Sampler, profile_dir: Path | None = None,
          **_: Any) -> dict[str, Any]:
    """One worker alone: ``size`` jobs waiting, the provider answering at once.

    The outbox holds the jobs until the worker is up and subscribed; then the relay starts
    and the worker drains them. The worker's CPU is its own for the drain (its start-up is
    before the phase); the relay's start is in the phase, not in the worker's figure.
    """
    with Rig(log=log) as rig:
        fp = rig.calmq("fake-provider")
        env = {"CALMQ_FAKE_PROVIDER_URL": fp.url}
        api = rig.calmq("api", env=env)
        tenant_id, key = rig.tenant(f"bench-drain-{uuid.uuid4().hex[:6]}")
        log(f"  calmq: {size} jobs accepted while no relay runs")
        load = asyncio.run(loadgen.closed_loop(f"{api.url}/v1/jobs", job_body(),
                                               {"Authorization": f"Bearer {key}"}, total=size,
                                               concurrency=E2E_CONCURRENCY))
        rig.stop("api")
        rig.calmq("worker", env=env)
        log("  calmq: one worker drains them (the relay starts now)")
        rig.statements_reset()
        phase = sampler.phase({**rig.pids("worker", "fake-provider"), **rig.infra_pids()})
        phase.pids["relay"] = rig.calmq("relay", env=env).pid
        wait(lambda: completed(rig, tenant_id), load.ok, 60 + size / 50, "drained jobs", log)
        sampler.end(phase)
        done, first, last = calmq_span(rig, tenant_id)
        figures = {"jobs_per_s": rounded(done / max(last - first, 1e-3)), "completed": done,
                   **process_costs(phase, ["worker"], done)}
        statements = rig.statements(done)
        rig.stop("worker")
        rig.stop("relay")
        jobs_table = hot_share(rig.table_updates("jobs"))

        skip = skip_locked_drain(rig, size, env, sampler, log, workers=64, pool_size=64,
                                  timeout=60 + size / 50)
        skip_statements = rig.statements(skip["completed"])
        versions = rig.versions
    res = result("drain", size, figures, {"skip_locked": skip},
                 {"jobs_per_s_vs_skip_locked": ratio(figures["jobs_per_s"],
                                                      skip["jobs_per_s"]),
                  **pg_ratio(figures, skip)},
                 versions, extra_versions={"load_generator": loadgen.NAME})
    res["pg_statements"] = {"calmq": statements, "skip_locked": skip_statements}
    res["jobs_table"] = jobs_table
    if profile_dir:
        write_statements(profile_dir / "drain-pg-statements.md", "drain", res)
    return res
