"""What the scenarios share: the shared constants, ways to start, wait for and cost a run,
read calmq's and the SKIP LOCKED baseline's figures from PostgreSQL, create topics, write
outbox rows, and round and compare figures. Public names only: a scenario module imports from
here, never another scenario's private helpers; the registry (bench/scenarios.py) imports the
scenarios.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench import loadgen
from bench.procs import LOADGEN, Phase, Sampler
from bench.rig import Rig
from bench.skip_locked import QUERIES as SKIP_LOCKED

__all__ = [
    "DISPATCH_RUNS", "E2E_CONCURRENCY", "PY", "RELAY_ROUTE", "RELAY_TOPIC", "Log",
    "NotBuiltError", "calmq_span", "completed", "copy_outbox", "count_completed",
    "create_topic", "dispatch_ms", "dispatch_runs", "high_watermark", "hot_share", "job_body",
    "median_run", "oneshot", "outbox_rows", "pg_ratio", "process_costs", "ratio", "relay_mode",
    "rounded",
    "skip_locked_drain", "skip_locked_last_id", "skip_locked_schema", "skip_locked_span",
    "statement_totals", "stderr", "wait", "write_statements",
]

PY = sys.executable
E2E_CONCURRENCY = 64
# The dispatch target holds for the median of five consecutive passes (issue 21).
DISPATCH_RUNS = 5
DISPATCH_RATE = 500.0  # jobs/s of a dispatch pass, for DISPATCH_SECONDS
DISPATCH_SECONDS = 5.0


class NotBuiltError(Exception):
    """The scenario needs a part of calmq that does not exist yet."""


Log = Callable[[str], None]


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- shared helpers ---------------------------------------------------------------------------

def job_body(text: str = "Kafka and PostgreSQL carry slow AI jobs.") -> dict[str, Any]:
    return {"workflow": "summarize", "input": {"text": text, "mode": "success"},
            "priority": "bulk"}


def process_costs(phase: Phase, own: list[str], jobs: int) -> dict[str, float]:
    """peak_rss_mb (sum of own processes' peaks) and CPU per 1,000 jobs, own and with infra."""
    per_k = 1000 / max(jobs, 1)
    own_cpu = sum(phase.cpu.get(n, 0.0) for n in own)
    all_cpu = sum(phase.cpu.values())
    figs = {
        "peak_rss_mb": round(sum(phase.peak_rss_mb.get(n, 0.0) for n in own), 1),
        "cpu_s_per_1000_jobs": round(all_cpu * per_k, 3),
        "cpu_s_per_1000_jobs_own": round(own_cpu * per_k, 3),
    }
    for name in own:
        key = name.replace("-", "_").replace(":", "_")
        figs[f"peak_rss_mb_{key}"] = round(phase.peak_rss_mb.get(name, 0.0), 1)
    for name in (*own, "postgres", "kafka", LOADGEN):
        if name in phase.cpu:
            figs[f"cpu_s_per_1000_jobs_{name}"] = round(phase.cpu[name] * per_k, 3)
    if "postgres" in phase.cpu:
        # The one writer a fleet cannot scale out: its CPU per job (postmaster, backends,
        # WAL sender, autovacuum) decides how many workers one database carries.
        figs["pg_cpu_ms_per_job"] = round(phase.cpu["postgres"] * per_k, 3)
    return figs


def oneshot(rig: Rig, name: str, argv: list[str], env: dict[str, str] | None = None,
             timeout: float = 300) -> tuple[dict[str, Any], float, float]:
    """Run a baseline to completion; its JSON line, CPU seconds (wait4) and peak RSS (MB)."""
    out_path = rig.dir / f"{name}.out"
    err_path = rig.dir / "logs" / f"{name}.log"
    err_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("wb") as out, err_path.open("ab") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=rig.child_env(env),
                                cwd=Path(__file__).resolve().parent.parent)
    deadline = time.monotonic() + timeout
    # Peak RSS by sampling: wait4's ru_maxrss starts from the parent's RSS at fork time.
    sampled = Phase({name: proc.pid})
    while True:
        sampled.sample()
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); see {err_path}")
    lines = out_path.read_text().strip().splitlines()
    return json.loads(lines[-1]), usage.ru_utime + usage.ru_stime, sampled.peak_rss_mb.get(name, 0)


def wait(check: Callable[[], int], target: int, timeout: float, what: str, log: Log) -> int:
    """Poll ``check`` until it reaches ``target`` or ``timeout``; returns the last value."""
    deadline = time.monotonic() + timeout
    value = check()
    while value < target and time.monotonic() < deadline:
        # A polling interval under a deadline. Not shorter: the count of a tenant's
        # completed jobs is PostgreSQL work charged to the scenario (pg_stat_statements put
        # a 0.1 s poll at a tenth of calmq's statement time per job in a small e2e run).
        time.sleep(0.5)
        value = check()
    if value < target:
        log(f"  {what}: only {value} of {target} within {timeout:.0f} s")
    return value


def completed(rig: Rig, tenant_id: str) -> int:
    row = rig.query("SELECT count(*) FROM jobs WHERE tenant_id = %s AND status = 'completed'",
                    (tenant_id,))
    return int(row[0][0])


def calmq_span(rig: Rig, tenant_id: str) -> tuple[int, float, float]:
    """(completed, first dispatch, last completion) as epoch seconds, from the job history."""
    row = rig.query(
        """SELECT count(*) FILTER (WHERE j.status = 'completed'),
                  extract(epoch FROM (SELECT min(e.at) FROM job_events e JOIN jobs k
                                      ON k.id = e.job_id
                                      WHERE k.tenant_id = %(t)s AND e.type = 'running')),
                  extract(epoch FROM max(j.updated_at) FILTER (WHERE j.status = 'completed'))
           FROM jobs j WHERE j.tenant_id = %(t)s""", {"t": tenant_id})[0]
    return int(row[0]), float(row[1] or 0), float(row[2] or 0)


def dispatch_ms(rig: Rig, tenant_id: str) -> list[float]:
    """accept→dispatch per job: its 'queued' event (written in the accepting transaction) to
    its first 'running' event (the worker's claim)."""
    rows = rig.query(
        """SELECT extract(epoch FROM min(r.at) - q.at) * 1000
           FROM jobs j JOIN job_events q ON q.job_id = j.id AND q.type = 'queued'
                       JOIN job_events r ON r.job_id = j.id AND r.type = 'running'
           WHERE j.tenant_id = %s GROUP BY j.id, q.at""", (tenant_id,))
    return [float(r[0]) for r in rows]


def skip_locked_schema(rig: Rig) -> None:
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        conn.execute(SKIP_LOCKED["schema"])


def skip_locked_last_id(rig: Rig) -> int:
    return int(rig.query(SKIP_LOCKED["last_id"])[0][0])


def skip_locked_span(rig: Rig, after: int) -> tuple[int, float, float]:
    row = rig.query(SKIP_LOCKED["summary"], {"after": after})[0]
    return int(row[0]), float(row[1] or 0), float(row[2] or 0)


def create_topic(bootstrap: str, name: str, partitions: int,
                  config: dict[str, str] | None = None) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions,
                                            replication_factor=1, config=config or {})])
    for future in futures.values():
        future.result(30)


def high_watermark(bootstrap: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4()}"})
    try:
        meta = consumer.list_topics(topic, timeout=10).topics[topic]
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                   for p in meta.partitions)
    finally:
        consumer.close()


def rounded(x: float, nd: int = 1) -> float:
    return round(x, nd)


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


# -- relay ------------------------------------------------------------------------------------

RELAY_ROUTE = "bench.relay"
RELAY_TOPIC = "calmq." + RELAY_ROUTE


def outbox_rows(count: int) -> list[tuple[Any, ...]]:
    from calmq import events

    tenant = str(uuid.uuid4())
    rows = []
    for _ in range(count):
        job_id = uuid.uuid4()
        event = events.requested({
            "id": job_id, "tenant_id": tenant, "workflow": "summarize", "workflow_version": 1,
            "step": "summarize", "attempt": 0, "priority": "bulk", "pool": "default"})
        rows.append((event["event_id"], RELAY_ROUTE, str(job_id), "job.requested",
                     json.dumps(event), "{}"))
    return rows


def copy_outbox(conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]]) -> None:
    with conn.cursor().copy(
        "COPY outbox (id, aggregatetype, aggregateid, type, payload, headers) FROM STDIN"
    ) as copy:
        for row in rows:
            copy.write_row(row)


def relay_mode() -> str:
    from calmq.settings import Settings

    return str(Settings.model_fields["relay_mode"].default)


def hot_share(updates: dict[str, int]) -> dict[str, Any]:
    """pg_stat_user_tables' counters of the jobs table, and the share of HOT updates."""
    upd = updates["updates"]
    return {**updates, "hot_share": round(updates["hot_updates"] / upd, 3) if upd else 0.0,
            "updates_per_insert": round(upd / updates["inserts"], 2)
            if updates["inserts"] else 0.0}


def pg_ratio(figures: dict[str, Any], skip: dict[str, Any]) -> dict[str, float]:
    """calmq's PostgreSQL CPU per job over the SKIP LOCKED queue's (target ≤ 0.5)."""
    if "pg_cpu_ms_per_job" in figures and skip.get("pg_cpu_ms_per_job"):
        return {"pg_cpu_ms_per_job_vs_skip_locked": ratio(figures["pg_cpu_ms_per_job"],
                                                           skip["pg_cpu_ms_per_job"])}
    return {}


def statement_totals(rig: Rig, jobs: int) -> dict[str, float]:
    """PostgreSQL's statements per job since the last reset, all of them (not the heaviest
    only): top-level calls and their execution and planning ms, and how many of the calls
    were planned (a prepared statement planned again is work a longer run would not repeat:
    psycopg prepares a statement on its fifth use on a connection, PostgreSQL keeps a
    generic plan from the sixth run of it). Nested calls (triggers, functions) apart."""
    row = rig.query(
        """SELECT coalesce(sum(calls) FILTER (WHERE toplevel), 0),
                  coalesce(sum(plans) FILTER (WHERE toplevel), 0),
                  coalesce(sum(total_exec_time) FILTER (WHERE toplevel), 0),
                  coalesce(sum(total_plan_time) FILTER (WHERE toplevel), 0),
                  coalesce(sum(calls) FILTER (WHERE NOT toplevel), 0)
           FROM pg_stat_statements WHERE query NOT ILIKE '%%pg_stat_statements%%'""")[0]
    calls, plans, exec_ms, plan_ms, nested = (float(v) for v in row)
    per = 1 / max(jobs, 1)
    return {"statements_per_job": round(calls * per, 3), "plans_per_job": round(plans * per, 3),
            "exec_ms_per_job": round(exec_ms * per, 4), "plan_ms_per_job": round(plan_ms * per, 4),
            "nested_statements_per_job": round(nested * per, 3)}


def write_statements(path: Path, scenario: str, res: dict[str, Any]) -> None:
    """The statement-level attribution (pg_stat_statements) of a scenario, as markdown."""
    lines = [f"# {scenario}: PostgreSQL statements per job (pg_stat_statements, track=all)", "",
             "Execution + planning time of each statement over the measured pass, per job "
             "completed. Nested statements (CTE parts are one statement; trigger bodies and "
             "functions are their own rows) are counted under their caller too, so the "
             "shares of top-level statements add up to 1, the rest overlap. Time is not CPU: "
             "a statement waiting for a lock counts here and not in `pg_cpu_ms_per_job`.", ""]
    figures = res["figures"]
    skip = res["baselines"].get("skip_locked", {})
    lines.append(f"PostgreSQL CPU per job (/proc): calmq {figures.get('pg_cpu_ms_per_job')} ms, "
                 f"skip_locked {skip.get('pg_cpu_ms_per_job')} ms.")
    if "jobs_table" in res:
        lines.append(f"jobs table over the run: {res['jobs_table']}.")
    for side, totals in res.get("pg_totals", {}).items():
        lines.append(f"{side}, all statements per job: {totals}.")
    for side, rows in res.get("pg_statements", {}).items():
        lines += ["", f"## {side}", "", "| ms/job | share | calls/job | rows/call | WAL B/job "
                  "| statement |", "|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {r['ms_per_job']:.4f} | {r['share_of_toplevel']:.1%} | "
                  f"{r['calls_per_job']} | {r['rows_per_call']} | {r['wal_bytes_per_job']} | "
                  f"`{r['query'].replace('|', '/')}` |" for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def count_completed(rig: Rig, tenant_id: str) -> Callable[[], int]:
    return lambda: completed(rig, tenant_id)


def dispatch_runs(rig: Rig, url: str, runs: int, log: Log, *, rate: float = DISPATCH_RATE,
                  label: str = "calmq", seconds: float = DISPATCH_SECONDS) -> dict[str, Any]:
    """The accept→dispatch pass at ``rate`` jobs/s for ``seconds``, ``runs`` times back to
    back (a tenant each); every run's p50/p99 and the median run's, which is what the
    target is held to."""
    passes: list[dict[str, float]] = []
    for n in range(runs):
        lat_id, key = rig.tenant(f"bench-dispatch-{uuid.uuid4().hex[:6]}")
        of = f" (run {n + 1} of {runs})" if runs > 1 else ""
        log(f"  {label}: accept→dispatch at {rate:.0f} jobs/s for {seconds:.0f} s{of}")
        fixed = asyncio.run(loadgen.open_loop(url, job_body(),
                                              {"Authorization": f"Bearer {key}"},
                                              rate=rate, seconds=seconds))
        wait(count_completed(rig, lat_id), fixed.ok, 60, "dispatch jobs", log)
        dispatch = dispatch_ms(rig, lat_id)
        passes.append({"p50_ms": rounded(loadgen.percentile(dispatch, 50), 2),
                       "p99_ms": rounded(loadgen.percentile(dispatch, 99), 2),
                       "rate": rounded(fixed.rate)})
    return {**median_run(passes),
            "dispatch_rate_achieved": rounded(min(p["rate"] for p in passes)),
            "dispatch_runs": len(passes),
            "dispatch_runs_meeting_target": sum(1 for p in passes if p["p50_ms"] <= 15
                                                and p["p99_ms"] <= 60),
            "dispatch_each_run": passes}


def median_run(passes: list[dict[str, float]]) -> dict[str, float]:
    """The dispatch runs' p50 and p99, each the median run's (the lower one of an even
    count)."""
    p50s = sorted(p["p50_ms"] for p in passes)
    p99s = sorted(p["p99_ms"] for p in passes)
    mid = (len(passes) - 1) // 2
    return {"dispatch_p50_ms": p50s[mid], "dispatch_p99_ms": p99s[mid]}


def skip_locked_drain(rig: Rig, size: int, env: dict[str, str], sampler: Sampler, log: Log,
                       *, workers: int, pool_size: int, timeout: float) -> dict[str, Any]:
    """The SKIP LOCKED queue draining ``size`` rows inserted before its workers start."""
    skip_locked_schema(rig)
    base = rig.start("sl_insert", [PY, "-m", "bench.skip_locked", "serve", "--port", "{port}"],
                     health="http")
    after = skip_locked_last_id(rig)
    bload = asyncio.run(loadgen.closed_loop(f"{base.url}/jobs", job_body(), {}, total=size,
                                            concurrency=E2E_CONCURRENCY))
    rig.stop("sl_insert")
    log(f"  baseline skip_locked: {workers} async workers drain {bload.ok} rows")
    rig.statements_reset()
    phase = sampler.phase({**rig.pids("fake-provider"), **rig.infra_pids()})
    proc = rig.start("sl_workers", [PY, "-m", "bench.skip_locked", "work", "--workers",
                                    str(workers), "--pool-size", str(pool_size)],
                     env=env, health="none")
    phase.pids["sl_workers"] = proc.pid
    wait(lambda: skip_locked_span(rig, after)[0], bload.ok, timeout, "skip_locked jobs", log)
    sampler.end(phase)
    rig.stop("sl_workers")
    done, first, last = skip_locked_span(rig, after)
    return {"jobs_per_s": rounded(done / max(last - first, 1e-3)), "completed": done,
            "workers": workers, **process_costs(phase, ["sl_workers"], done)}
