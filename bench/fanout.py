"""``calmq bench fanout``: one parent with ``size`` child jobs against as many independent jobs.

A ``bench_fanout`` job (bench/fanout_workflows.py) starts ``size`` summarize children in one
step, and its next step runs once all have joined (docs/how-to/fan-out.md). Figures: the
children's throughput (first child claimed to last child completed), PostgreSQL CPU per
child, the time from the last child's completion to the parent's next step being claimed
(one parent: one sample, reported as its p99 too), and the checks that the join fired
exactly once, no child was lost and none completed twice. Baseline ``independent``: the same
number of summarize jobs submitted on their own and queued before the worker starts, on the
same stack; ``ratios``: calmq's children over it (throughput, and PostgreSQL CPU per job).

Throughput is also read over the work's whole life (``..._whole_life``): the children's from
the parent's first claim (its spawning step writes them) to the last child's completion,
against a third pass, ``independent_posted_while_running``: as many independent jobs posted
one by one while a worker runs them, from the first claim to the last completion. The
first-claim span of the jobs queued beforehand leaves their creation and publication out,
while the children's span holds theirs (the spawn and each release run beside the
attempts); the whole-life pair charges both sides the same work, as the PostgreSQL figure
below does.

PostgreSQL CPU is charged over each job's whole life on both sides: the children's phase
holds their creation (the parent's spawn writes them), so the independent jobs' holds their
submission too (``pg_cpu_ms_per_job``; ``pg_cpu_ms_per_job_run_only`` is the run without it,
which is what this scenario compared before 2026-12-07). ``pg_statements`` (top level of the
result) attributes each side's PostgreSQL time to its statements (pg_stat_statements,
trigger bodies included), per job.

``--kill worker`` or ``--kill relay`` (or ``BENCH_KILL``): once about half the children
have completed, that process gets SIGKILL (it and its process group, no shutdown of its
own) and is started again, as the chaos tests do (tests/chaos/test_fanout_kill.py); the
figures then say what the kill cost: children lost, completed twice (two ``completed``
events), joins fired (one), the children running at the kill and requeued after it, how
long after the kill the next child completed, and the children the fake provider was
called for (and answered) more than once: a call in flight at a worker's kill is made
again by the next attempt, paid twice but completed once. The restarted
process's CPU is added to its predecessor's, so the per-child figures hold the whole phase.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
import uuid
from typing import Any

from bench import fanout_workflows, loadgen
from bench.procs import Phase, Sampler, cpu_seconds
from bench.report import result
from bench.rig import Rig

__all__ = ["DEFAULT_SIZE", "KILLABLE", "fanout"]

DEFAULT_SIZE = 100_000
CONCURRENCY = "256"
KILLABLE = ("worker", "relay")
Log = Any


def _wait(check: Any, timeout: float, what: str, log: Log) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)  # a polling interval under a deadline
    log(f"  {what}: not within {timeout:.0f} s")
    return False


def _span(rig: Rig, where: str, params: tuple[Any, ...]) -> tuple[float, float, int]:
    """First claim and last completion (epoch seconds) of the jobs ``where`` selects, and
    how many completed (each job once, however many ``completed`` events it has)."""
    row = rig.query(
        f"""SELECT extract(epoch FROM min(e.at) FILTER (WHERE e.type = 'running')),
                   extract(epoch FROM max(e.at) FILTER (WHERE e.type = 'completed')),
                   count(DISTINCT e.job_id) FILTER (WHERE e.type = 'completed')
            FROM job_events e JOIN jobs j ON j.id = e.job_id WHERE {where}""", params)[0]
    return float(row[0] or 0), float(row[1] or 0), int(row[2] or 0)


def _per_job(cpu: dict[str, float], jobs: int) -> dict[str, float]:
    """CPU milliseconds per job of each process of a phase: on a host where every part
    shares the cores, what one side spends more bounds its rate."""
    return {name: round(s * 1000 / max(jobs, 1), 3) for name, s in sorted(cpu.items())}


def _settled(rig: Rig, parent_id: str) -> int:
    """Children the parent's join has counted (one row: cheap to poll at any size)."""
    rows = rig.query("SELECT coalesce(sum(succeeded + failed), 0) FROM job_joins"
                     " WHERE parent_id = %s", (parent_id,))
    return int(rows[0][0]) if rows else 0


def _start(rig: Rig, name: str, env: dict[str, str]) -> int:
    args = ("--concurrency", CONCURRENCY) if name == "worker" else ()
    return rig.calmq(name, *args, env=env).pid


def _kill_midway(rig: Rig, log: Log, phase: Phase, env: dict[str, str], parent_id: str,
                 size: int, name: str) -> dict[str, Any]:
    """SIGKILL ``name`` once half the children are settled, start it again; what it hit."""
    if not _wait(lambda: _settled(rig, parent_id) >= size // 2, 600 + size / 20,
                 f"{size // 2} children settled before the kill", log):
        return {"killed": name, "kill_skipped": True}
    running = int(rig.query("SELECT count(*) FROM jobs WHERE parent_id = %s"
                            " AND status = 'running'", (parent_id,))[0][0])
    at_kill = _settled(rig, parent_id)
    # The victim's CPU so far in this phase, carried over to the process that replaces it.
    used = cpu_seconds(phase.pids[name]) - phase.cpu_start.get(name, 0.0)
    killed_at = time.time()
    rig.stop(name, sig=signal.SIGKILL)
    log(f"  kill -9 {name} with {at_kill} of {size} children settled, {running} running")
    pid = _start(rig, name, env)
    restarted = time.time()
    phase.pids[name] = pid
    phase.cpu_start[name] = cpu_seconds(pid) - used
    return {"killed": name, "settled_at_kill": at_kill, "running_at_kill": running,
            "restart_s": round(restarted - killed_at, 2), "killed_at": killed_at,
            "restarted_at": restarted}


def _kill_figures(rig: Rig, parent_id: str, kill: dict[str, Any],
                  provider_url: str) -> dict[str, Any]:
    """After the run: children requeued after the kill, the first completion after the
    restart, and the children the fake provider answered more than once."""
    if not kill or kill.get("kill_skipped"):
        return kill
    requeued, first = rig.query(
        "SELECT count(DISTINCT e.job_id) FILTER (WHERE e.type = 'requeued_after_restart'),"
        " extract(epoch FROM min(e.at) FILTER (WHERE e.type = 'completed'"
        "   AND e.at > to_timestamp(%s)))"
        " FROM job_events e JOIN jobs j ON j.id = e.job_id WHERE j.parent_id = %s",
        (kill["restarted_at"], parent_id))[0]
    with urllib.request.urlopen(f"{provider_url}/stats", timeout=120) as resp:
        by_job = json.loads(resp.read()).get("by_job", {})
    killed_at = kill.pop("killed_at")
    kill.pop("restarted_at")
    return {**kill, "children_requeued_after_restart": int(requeued or 0),
            "next_completion_after_kill_s": round(float(first) - killed_at, 2)
            if first else None,
            "provider_calls_repeated": sum(1 for v in by_job.values() if v["calls"] > 1),
            "provider_answered_twice": sum(1 for v in by_job.values() if v["completed"] > 1)}


def _children(rig: Rig, log: Log, sampler: Sampler, env: dict[str, str], size: int,
              key: str, api_url: str, kill: str | None = None) -> dict[str, Any]:
    rig.statements_reset()
    phase = sampler.phase({**rig.pids("relay", "fake-provider"), **rig.infra_pids()})
    phase.pids["worker"] = _start(rig, "worker", env)
    req = urllib.request.Request(
        f"{api_url}/v1/jobs", method="POST",
        data=json.dumps({"workflow": fanout_workflows.WORKFLOW, "priority": "bulk",
                         "input": {"n": size}}).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        parent_id = json.loads(resp.read())["job_id"]
    log(f"  calmq: parent {parent_id} with {size} children")
    killed = _kill_midway(rig, log, phase, env, parent_id, size, kill) if kill else {}
    _wait(lambda: rig.query("SELECT status FROM jobs WHERE id = %s",
                            (parent_id,))[0][0] in ("completed", "dead_letter", "cancelled"),
          600 + size / 20, "the parent", log)
    sampler.end(phase)
    rig.stop("worker")
    first, last, done = _span(rig, "j.parent_id = %s", (parent_id,))
    statements = rig.statements(done)
    events = rig.query("SELECT type, extract(epoch FROM at) FROM job_events WHERE job_id = %s"
                       " ORDER BY id", (parent_id,))
    joined = [t for k, t in events if k == "children_joined"]
    claims = [float(t) for k, t in events if k == "running"]
    resumed = claims[1] if len(claims) > 1 else 0.0  # the gather step's claim
    twice = int(rig.query(
        "SELECT count(*) FROM (SELECT e.job_id FROM job_events e JOIN jobs j ON j.id = e.job_id"
        " WHERE j.parent_id = %s AND e.type = 'completed' GROUP BY e.job_id"
        " HAVING count(*) > 1) t", (parent_id,))[0][0])
    status = rig.query("SELECT status FROM jobs WHERE id = %s", (parent_id,))[0][0]
    resume_ms = round((resumed - last) * 1000, 1) if resumed and last else None
    return {
        "children_per_s": round(done / max(last - first, 1e-3), 1),
        # From the parent's first claim (its spawning step: the children's creation) to
        # the last child's completion.
        "children_per_s_whole_life": round(done / max(last - claims[0], 1e-3), 1)
        if claims else 0.0,
        "children_completed": done, "children_lost": size - done,
        "children_completed_twice": twice, "joins_fired": len(joined),
        "parent_status": status,
        "resume_after_last_child_ms": resume_ms, "resume_p99_ms": resume_ms,
        "pg_cpu_ms_per_child": round(phase.cpu.get("postgres", 0.0) * 1000 / max(done, 1), 3),
        "cpu_s_per_1000_jobs": round(sum(phase.cpu.values()) * 1000 / max(done, 1), 3),
        "peak_rss_mb": round(phase.peak_rss_mb.get("worker", 0.0), 1),
        "cpu_ms_per_job_by_process": _per_job(phase.cpu, done),
        **_kill_figures(rig, parent_id, killed, env["CALMQ_FAKE_PROVIDER_URL"]),
        "pg_statements": statements,
    }


def _post_independent(api_url: str, key: str, size: int) -> loadgen.LoadResult:
    """``size`` summarize jobs, each its own POST, from 64 connections."""
    return asyncio.run(loadgen.closed_loop(
        f"{api_url}/v1/jobs",
        {"workflow": "summarize", "priority": "bulk",
         "input": {"text": fanout_workflows.TEXT, "mode": "success"}},
        {"Authorization": f"Bearer {key}"}, total=size, concurrency=64))


def _wait_until_run(rig: Rig, log: Log, tenant_id: str, size: int, what: str) -> None:
    """Until none of the tenant's jobs is left to run. An EXISTS the
    partial indexes of the unfinished statuses answer: counting the completed ones every
    half second read the tenant's every job, 0.25 ms of PostgreSQL time per job at 100,000,
    charged to that side's CPU."""
    _wait(lambda: not rig.query(
              "SELECT EXISTS (SELECT 1 FROM jobs WHERE tenant_id = %s AND status IN"
              " ('queued', 'retrying', 'running', 'awaiting_review'))", (tenant_id,))[0][0],
          600 + size / 20, what, log)


def _independent(rig: Rig, log: Log, sampler: Sampler, env: dict[str, str], size: int,
                 key: str, tenant_id: str, api_url: str) -> dict[str, Any]:
    # The submission is charged too (see the module's docstring): the children's phase
    # holds their creation.
    rig.statements_reset()
    submit = sampler.phase({**rig.pids("api", "relay"), **rig.infra_pids()})
    load = _post_independent(api_url, key, size)
    log(f"  independent: {load.ok} jobs queued")
    # The run's phase starts as this one ends: their sum is the jobs' whole life, whatever
    # of the relay's decoding falls after the split.
    sampler.end(submit)
    phase = sampler.phase({**rig.pids("relay", "fake-provider"), **rig.infra_pids()})
    worker = rig.calmq("worker", "--concurrency", CONCURRENCY, env=env)
    phase.pids["worker"] = worker.pid
    _wait_until_run(rig, log, tenant_id, size, "the independent jobs")
    sampler.end(phase)
    rig.stop("worker")
    first, last, done = _span(rig, "j.tenant_id = %s", (tenant_id,))
    run_ms = phase.cpu.get("postgres", 0.0) * 1000
    submit_ms = submit.cpu.get("postgres", 0.0) * 1000
    return {"jobs_per_s": round(done / max(last - first, 1e-3), 1), "completed": done,
            "pg_cpu_ms_per_job": round((submit_ms + run_ms) / max(done, 1), 3),
            "pg_cpu_ms_per_job_run_only": round(run_ms / max(done, 1), 3),
            "cpu_ms_per_job_by_process": _per_job(phase.cpu, done),
            "submit_cpu_ms_per_job_by_process": _per_job(submit.cpu, done),
            "pg_statements": rig.statements(done)}


def _independent_streamed(rig: Rig, log: Log, sampler: Sampler, env: dict[str, str],
                          size: int, key: str, tenant_id: str,
                          api_url: str) -> dict[str, Any]:
    """The same number of independent jobs posted one by one while a worker runs them, as a
    backfill by single POSTs would be: the rate from the first claim to the last completion
    while the POSTs go on, against the children's from the parent's first claim (its
    spawning step) to their last completion. Both spans then hold the jobs' creation and
    publication, which the span of the independent jobs queued beforehand leaves out while
    the children's holds it (their spawn and release run beside their attempts)."""
    phase = sampler.phase({**rig.pids("api", "relay", "fake-provider"), **rig.infra_pids()})
    worker = rig.calmq("worker", "--concurrency", CONCURRENCY, env=env)
    phase.pids["worker"] = worker.pid
    load = _post_independent(api_url, key, size)
    log(f"  independent, posted while running: {load.ok} jobs accepted")
    _wait_until_run(rig, log, tenant_id, size, "the independent jobs posted while running")
    sampler.end(phase)
    rig.stop("worker")
    first, last, done = _span(rig, "j.tenant_id = %s", (tenant_id,))
    return {"jobs_per_s_whole_life": round(done / max(last - first, 1e-3), 1),
            "completed": done, "accepts_per_s": round(load.ok / max(load.elapsed_s, 1e-3), 1),
            "cpu_ms_per_job_by_process": _per_job(phase.cpu, done),
            "cpu_s_per_1000_jobs": round(sum(phase.cpu.values()) * 1000 / max(done, 1), 3)}


def fanout(size: int, log: Log, sampler: Sampler, kill: str | None = None,
           **_: Any) -> dict[str, Any]:
    kill = kill or os.environ.get("BENCH_KILL") or None
    if kill is not None and kill not in KILLABLE:
        raise ValueError(f"--kill: one of {', '.join(KILLABLE)}, not {kill!r}")
    with Rig(log=log) as rig:
        fp = rig.calmq("fake-provider")
        env = {"CALMQ_FAKE_PROVIDER_URL": fp.url,
               "CALMQ_WORKFLOW_MODULES": "bench.fanout_workflows",
               "CALMQ_CHILDREN_PER_PARENT_MAX": str(max(size, 100_000))}
        api = rig.calmq("api", env=env)
        rig.calmq("relay", env=env)
        _tenant, key = rig.tenant(f"bench-fanout-{uuid.uuid4().hex[:6]}")
        figures = _children(rig, log, sampler, env, size, key, api.url, kill)
        tenant_b, key_b = rig.tenant(f"bench-independent-{uuid.uuid4().hex[:6]}")
        base = _independent(rig, log, sampler, env, size, key_b, tenant_b, api.url)
        tenant_c, key_c = rig.tenant(f"bench-streamed-{uuid.uuid4().hex[:6]}")
        streamed = _independent_streamed(rig, log, sampler, env, size, key_c, tenant_c,
                                         api.url)
        versions = rig.versions
    statements = {"children": figures.pop("pg_statements"),
                  "independent": base.pop("pg_statements")}
    ratios = {"children_per_s_vs_independent": round(
                  figures["children_per_s"] / max(base["jobs_per_s"], 1e-3), 3),
              "children_per_s_vs_independent_whole_life": round(
                  figures["children_per_s_whole_life"]
                  / max(streamed["jobs_per_s_whole_life"], 1e-3), 3),
              "pg_cpu_per_child_vs_independent": round(
                  figures["pg_cpu_ms_per_child"] / max(base["pg_cpu_ms_per_job"], 1e-6), 3),
              "pg_cpu_per_child_vs_independent_run_only": round(
                  figures["pg_cpu_ms_per_child"]
                  / max(base["pg_cpu_ms_per_job_run_only"], 1e-6), 3)}
    res = result("fanout", size, figures,
                 {"independent": base, "independent_posted_while_running": streamed},
                 ratios, versions,
                 extra_versions={"load_generator": loadgen.NAME})
    res["pg_statements"] = statements
    return res
