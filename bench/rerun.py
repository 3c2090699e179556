"""``calmq bench rerun``: what an interactive job experiences while a bulk rerun runs.

Issue 43's target: a bulk rerun of 1,000 jobs (``calmq jobs rerun`` by filter) keeps the
interactive p99 within 1.2x of its baseline while it runs. The rig is ``priority``'s (the
fake provider's request limit as the fleet budget, the same interactive load): first the
interactive load alone (baseline ``no_rerun``), then ``size`` completed jobs of one tenant
are rerun from their step by the CLI, paced by the budget (no ``--rate``), while the same
interactive load runs again. The ratio is the second p99 over the first.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import psutil  # type: ignore[import-untyped]

from bench import loadgen
from bench.common import completed, wait
from bench.histograms import quantiles, scrape
from bench.priority import (
    BUDGET_RPM,
    INTERACTIVE_RATE,
    PROVIDER_LATENCY_MS,
    WORKERS,
    body,
    interactive_pass,
    stack,
)
from bench.procs import Phase, Sampler
from bench.report import result
from bench.rig import Rig

__all__ = ["DEFAULT_SIZE", "rerun"]

DEFAULT_SIZE = 1000
INTERACTIVE_SECONDS = 30.0

Log = Any



def _reruns(rig: Rig, tenant_id: str) -> tuple[int, int]:
    """(reruns made, reruns completed) of the tenant's jobs."""
    row = rig.query("SELECT count(*), count(*) FILTER (WHERE status = 'completed') FROM jobs "
                    "WHERE tenant_id = %s AND rerun_of IS NOT NULL", (tenant_id,))[0]
    return int(row[0]), int(row[1])


def _cpu_by_process(phase: Phase, jobs: int) -> dict[str, float]:
    """CPU milliseconds a job of each process of a phase (every process shares the cores)."""
    return {n: round(c * 1000 / max(jobs, 1), 2) for n, c in sorted(phase.cpu.items())}


class _CliCpu(threading.Thread):
    """The rerun CLI's CPU seconds, read until it exits (a reaped process has none)."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="rerun-cli-cpu", daemon=True)
        self.pid, self.seconds = pid, 0.0

    def run(self) -> None:
        while True:
            try:
                t = psutil.Process(self.pid).cpu_times()
                self.seconds = float(t.user + t.system)
            except psutil.Error:
                return
            time.sleep(0.1)  # a poll until the process is gone




def _measured(rig: Rig, sampler: Sampler, url: str, names: list[str], seconds: float,
              label: str, log: Log) -> tuple[dict[str, Any], Phase]:
    """One interactive pass with the workers' histograms and every process's CPU."""
    phase = sampler.phase({**rig.pids(*names, "api", "relay", "fake-provider"),
                           **rig.infra_pids()})
    scraped = scrape(rig, names)
    figures, _t0, _t1, _n = interactive_pass(rig, url, seconds, label, log)
    figures["worker_histograms"] = quantiles(scraped, scrape(rig, names))
    sampler.end(phase)
    return figures, phase


def rerun(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    seconds = max(10.0, min(INTERACTIVE_SECONDS, INTERACTIVE_SECONDS * size / DEFAULT_SIZE))
    with Rig(log=log) as rig:
        url, env, names = stack(rig, log)
        quiet, quiet_phase = _measured(rig, sampler, url, names, seconds, "no-rerun", log)
        quiet["cpu_ms_per_job_by_process"] = _cpu_by_process(
            quiet_phase, quiet["interactive_completed"])

        name = f"bench-originals-{uuid.uuid4().hex[:6]}"
        originals_id, key = rig.tenant(name)
        log(f"  calmq: {size} bulk jobs to complete, the originals of the rerun")
        asyncio.run(loadgen.closed_loop(url, body("bulk"), {"Authorization": f"Bearer {key}"},
                                        total=size, concurrency=64))
        wait(lambda: completed(rig, originals_id), size, 300, "the originals", log)

        log("  calmq: calmq jobs rerun of every original, paced by the budget, with the "
            "interactive load")
        started = time.monotonic()
        cli = subprocess.Popen(
            [sys.executable, "-m", "calmq.cli", "jobs", "rerun", "--from-step", "summarize",
             "--workflow", "summarize", "--tenant", name, "--status", "completed", "--yes",
             "-o", "json"],
            env=rig.child_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        cli_cpu = _CliCpu(cli.pid)
        cli_cpu.start()
        made_before = _reruns(rig, originals_id)[0]
        busy, phase = _measured(rig, sampler, url, names, seconds, "with-rerun", log)
        made_during = _reruns(rig, originals_id)[0] - made_before
        _out, err = cli.communicate(timeout=600)
        cli_seconds = time.monotonic() - started
        cli_cpu.join(timeout=5)
        made, reran = _reruns(rig, originals_id)
        if cli.returncode != 0:
            log(f"  warning: calmq jobs rerun exited {cli.returncode}: {err[-500:]}")
        if made_during == 0:
            log("  warning: no rerun was made while the interactive load ran")
        jobs = busy["interactive_completed"] + made_during
        figures: dict[str, Any] = {
            **busy,
            "reruns_made": made, "reruns_completed": reran,
            "reruns_made_during_interactive": made_during,
            "rerun_cli_seconds": round(cli_seconds, 1), "rerun_cli_exit": cli.returncode,
            "rerun_cli_cpu_ms_per_rerun": round(cli_cpu.seconds * 1000 / max(made, 1), 2),
            "rerun_count_line": next((ln for ln in err.splitlines() if "to rerun" in ln), ""),
            "budget_requests_per_minute": BUDGET_RPM, "provider_latency_ms": PROVIDER_LATENCY_MS,
            "interactive_rate": INTERACTIVE_RATE, "interactive_seconds": seconds,
            "workers": WORKERS,
            "cpu_s_per_1000_jobs": round(sum(phase.cpu.values()) * 1000 / max(jobs, 1), 3),
            "cpu_ms_per_job_by_process": _cpu_by_process(phase, jobs),
        }
        versions = rig.versions
    return result("rerun", size, figures, {"no_rerun": quiet},
                  {"interactive_p99_ms_vs_no_rerun": round(
                      busy["interactive_p99_ms"] / quiet["interactive_p99_ms"], 3)
                   if quiet["interactive_p99_ms"] else 0.0},
                  versions, extra_versions={"load_generator": loadgen.NAME})
