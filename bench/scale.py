"""The scale scenario (month six): calmq on an empty database and on one preloaded with
months of a fleet's jobs, in one run, on one PostgreSQL server.

Two databases of the same server (same settings, same cache, same disk): ``calmq`` stays
empty and is measured first; then ``calmq_scale`` is preloaded (bench/preload.py: ``size``
jobs over 30 days, 50 tenants on a Zipf tail, their events, attempts, dead letters and
reviews) while no calmq process runs and no replication slot exists, so the load's WAL is
nobody's to decode, and measured once autovacuum has finished with the load. On each:

- ``e2e``: jobs through API, relay and worker from 64 connections (jobs/s) and PostgreSQL's
  CPU per job over that pass;
- accept→dispatch p50/p99 at a paced rate: 500 jobs/s, or half the empty database's e2e rate
  where that is less (a rate the host cannot carry measures a queue's growth), the same
  rate for both databases. Its 10-second runs come in pairs after the preload, one run on
  each database, every other pair reversed (empty, preloaded, preloaded, empty, ...), each
  run on a stack started on its database and warmed up. The ratio is the median of the
  pairs' ratios; each side's p50/p99 is its median run. (One run's p99 is a few dozen jobs,
  and a stall of the host moves it 2-5x: with the empty side measured before the preload
  and the preloaded side twenty minutes later, two 20 M runs of the same code put the
  ratio of their medians of three at 0.86x and 1.66x.)

and on the preloaded one:

- reads over HTTP, p50/p99: ``GET /v1/jobs/{id}``, the first page of ``GET /v1/jobs`` and of
  ``?status=dead_letter`` for the largest tenant and a small one, the console's overview,
  job list and metadata search (signed in as the largest tenant);
- ``calmq dlq summary`` (the CLI, wall time) and the reaper's and sweeper's passes (their
  statements through the data layer, as the processes run them);
- a steady run: intake at 500 jobs/s for ``steady_seconds`` (30 minutes by default, a minute
  for a smoke size) while the API's retention sweep retires the jobs past 20 days: jobs
  retired per second beside the intake, and the tables' sizes and dead tuples before and
  after.

The targets (issue "month six") are computed into ``ratios`` and ``targets``; what limits a
missed one is for BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.parse
import uuid
from typing import Any

import aiohttp
import psycopg

from bench import loadgen
from bench.common import (
    DISPATCH_RATE,
    E2E_CONCURRENCY,
    Log,
    calmq_span,
    completed,
    count_completed,
    dispatch_runs,
    job_body,
    median_run,
    process_costs,
    ratio,
    rounded,
    wait,
)
from bench.loadgen import percentile
from bench.preload import preload, tenant_names
from bench.procs import Sampler
from bench.report import result
from bench.rig import Rig
from bench.scrape import scrape

__all__ = ["paired_interval", "paired_ratio", "scale", "turns"]

INTAKE_RATE = 500.0  # the steady run's intake, jobs/s
RETENTION_DAYS = 20  # of the preload's 30: a third of the preloaded jobs are past it
READS = 200  # requests per read measured
READ_SECONDS = 120.0  # ... unless they take longer: then as many as fit, READ_MIN at least
READ_MIN = 10
FULL_STEADY_SECONDS = 1800.0
SMOKE_STEADY_SECONDS = 60.0
SMOKE_BELOW = 1_000_000  # a smaller preload is a smoke run: a one-minute steady run
E2E_JOBS = 5000
# Jobs run before the e2e pass is measured, so that what it measures is a running fleet's
# PostgreSQL work, not its connections' first executions: psycopg prepares a statement at
# its 5th execution on a connection, and PostgreSQL plans the first 5 executions of a
# prepared statement anew before it settles on a generic plan. The worker's 12 connections
# need about 11 claims and 11 finishes each (some 80 jobs a call), about 12,000 jobs; with
# 200, the pass's 5,000 jobs ran mostly on connections still planning every execution, and
# a plan over 33 partitions a history table costs more than over 4 (the 20 M run's planning).
WARM_JOBS = 15_000
# Jobs run on a stack just started on a database before its dispatch run: its worker in the
# consumer group and its connections past their first executions.
DISPATCH_WARM_JOBS = 3000
# Dispatch runs a database, in pairs (see ``turns``), and each run's length. A 10-second
# run's p99 is its 50 slowest jobs, and one stall of the host (a few a minute on two cores
# running every part) moves it by 2-5x. In an A/A trial on one database, the ratio of two
# sides' median runs ranged 0.20-4.87 with three runs a side and 0.71-1.44 with eight; the
# median of eight paired ratios, 0.95-1.09 (bench/results/notes/2026-12-06-dispatch-aa.json).
# Eight pairs were not enough at 200,000 jobs: 0.37x and 1.79x in two runs; with 24 at 20 M
# the median's 95 % bootstrap interval was 0.65-1.38 (paired_interval reports it).
DISPATCH_PAIRS = 24
DISPATCH_TURN_SECONDS = 10.0
# The empty database's relay slot once the preload is in (the first one is dropped for it).
EMPTY_SLOT = "calmq_empty_outbox"
FULL_SLOT = "calmq_scale_outbox"
# Bulk loads: WAL and checkpoints sized so the preload is not a checkpoint storm.
_LOAD_SETTINGS = {"max_wal_size": "8GB", "checkpoint_timeout": "30min"}


# -- the database's own figures -------------------------------------------------------------------

_TABLES = """
SELECT root.relname AS name,
       sum(pg_relation_size(s.relid))::bigint AS heap_bytes,
       sum(pg_indexes_size(s.relid))::bigint AS index_bytes,
       sum(COALESCE(pg_total_relation_size(c.reltoastrelid), 0))::bigint AS toast_bytes,
       sum(s.n_live_tup)::bigint AS live, sum(s.n_dead_tup)::bigint AS dead
FROM pg_stat_user_tables s
JOIN pg_class c ON c.oid = s.relid
JOIN pg_class root ON root.oid = COALESCE(pg_partition_root(s.relid), s.relid)
WHERE root.relname IN ('jobs', 'job_events', 'job_attempts', 'outbox', 'step_outputs',
                       'idempotency_keys', 'job_outputs')
GROUP BY root.relname ORDER BY root.relname
"""


def _tables(url: str) -> dict[str, dict[str, Any]]:
    """Heap, index and TOAST bytes, live and dead tuples and the dead ratio of the growing
    tables (partitions summed under their table)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(_TABLES).fetchall()
    out = {}
    for name, heap, index, toast, live, dead in rows:
        total = int(live) + int(dead)
        out[str(name)] = {"heap_mb": rounded(int(heap) / 2**20), "index_mb":
                          rounded(int(index) / 2**20), "toast_mb": rounded(int(toast) / 2**20),
                          "live": int(live), "dead": int(dead),
                          "dead_ratio": round(int(dead) / total, 4) if total else 0.0}
    return out


def _database_mb(url: str) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    return rounded(int(row[0]) / 2**20) if row else 0.0


def _autovacuum_quiet(url: str, log: Log, within: float = 900.0) -> None:
    """Wait (up to ``within`` seconds) until no autovacuum worker runs: after a bulk load
    autovacuum analyzes and freezes for a while, and that work belongs to no phase."""
    deadline = time.monotonic() + within
    busy: list[tuple[Any, ...]] = []
    while time.monotonic() < deadline:
        with psycopg.connect(url, autocommit=True) as conn:
            busy = conn.execute("SELECT query FROM pg_stat_activity"
                                " WHERE backend_type = 'autovacuum worker'").fetchall()
        if not busy:
            return
        time.sleep(5)  # polling under a deadline
    log(f"  autovacuum still busy after {within:.0f} s: {[r[0] for r in busy]}")


# Where PostgreSQL's CPU per job goes besides the statements: WAL, blocks read from outside
# shared buffers, and the maintenance that ran during the pass. (Full-page images stay 0
# on the dev stack, which runs with full_page_writes off; a production server writes them.)
_SERVER_COUNTERS = """
SELECT (SELECT wal_records FROM pg_stat_wal), (SELECT wal_fpi FROM pg_stat_wal),
       (SELECT wal_bytes FROM pg_stat_wal),
       (SELECT blks_read FROM pg_stat_database WHERE datname = current_database()),
       (SELECT blks_hit FROM pg_stat_database WHERE datname = current_database()),
       (SELECT num_done FROM pg_stat_checkpointer),
       (SELECT coalesce(sum(autovacuum_count), 0) FROM pg_stat_user_tables),
       (SELECT coalesce(sum(autoanalyze_count), 0) FROM pg_stat_user_tables),
       (SELECT n_tup_upd FROM pg_stat_user_tables WHERE relid = 'jobs'::regclass),
       (SELECT n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'jobs'::regclass)
"""
_COUNTER_NAMES = ("wal_records", "wal_fpi", "wal_bytes", "blocks_read", "blocks_hit",
                  "checkpoints", "autovacuums", "autoanalyzes", "jobs_updates",
                  "jobs_hot_updates")


def _server_counters(url: str) -> dict[str, float]:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(_SERVER_COUNTERS).fetchone()
    return {name: float(v or 0) for name, v in zip(_COUNTER_NAMES, row or (), strict=True)}


def _per_job(before: dict[str, float], after: dict[str, float], jobs: int) -> dict[str, float]:
    """Counters over a pass per job completed; maintenance runs and checkpoints as counts."""
    out: dict[str, float] = {}
    # The share of the job rows' updates (claim, heartbeats, finish) that were HOT: no new
    # index entry, the new version on the same page (issue 32 asks whether a narrower hot
    # table would raise it).
    updates = after["jobs_updates"] - before["jobs_updates"]
    out["jobs_hot_update_share"] = round(
        (after["jobs_hot_updates"] - before["jobs_hot_updates"]) / updates, 3) if updates else 0.0
    for name in _COUNTER_NAMES:
        if name in ("autovacuums", "autoanalyzes", "checkpoints"):
            out[name] = after[name] - before[name]
        else:
            out[f"{name}_per_job"] = round((after[name] - before[name]) / max(jobs, 1), 2)
    return out


def _statement_growth(empty: list[dict[str, Any]], full: list[dict[str, Any]],
                      top: int = 10) -> list[dict[str, Any]]:
    """The statements whose time per job grew most from the empty database to the
    preloaded one (matched by their normalised text)."""
    before = {row["query"]: row for row in empty}
    rows = []
    for row in full:
        was = before.get(row["query"], {})
        rows.append({"query": row["query"],
                     "ms_per_job_empty": was.get("ms_per_job", 0.0),
                     "ms_per_job_preloaded": row["ms_per_job"],
                     "growth_ms_per_job": round(row["ms_per_job"] - was.get("ms_per_job", 0.0),
                                                4),
                     "plan_ms_per_job_empty": was.get("plan_ms_per_job", 0.0),
                     "plan_ms_per_job_preloaded": row.get("plan_ms_per_job", 0.0),
                     "blocks_read_per_job_preloaded": row.get("blocks_read_per_job", 0.0),
                     "wal_bytes_per_job_empty": was.get("wal_bytes_per_job", 0.0),
                     "wal_bytes_per_job_preloaded": row["wal_bytes_per_job"]})
    rows.sort(key=lambda r: r["growth_ms_per_job"], reverse=True)
    return rows[:top]


# -- the e2e pass ---------------------------------------------------------------------------------

def _services(rig: Rig, fake_url: str, *, retention_days: float = 0) -> dict[str, str]:
    """API, relay and worker on the rig's current database; returns their env."""
    env = {"CALMQ_FAKE_PROVIDER_URL": fake_url,
           "CALMQ_JOB_RETENTION_SECONDS": str(retention_days * 86400)}
    rig.calmq("api", env=env)
    rig.calmq("relay", env=env)
    rig.calmq("worker", env=env)
    return env


def _warm(rig: Rig, label: str, jobs: int, log: Log) -> None:
    """``jobs`` through the current stack from 64 connections, waited for."""
    url = f"{rig.procs['api'].url}/v1/jobs"
    warm_id, key = rig.tenant(f"bench-warm-{label}-{uuid.uuid4().hex[:6]}")
    log(f"  {label}: {jobs} warm-up jobs")
    warm = asyncio.run(loadgen.closed_loop(url, job_body(), {"Authorization": f"Bearer {key}"},
                                           total=jobs, concurrency=E2E_CONCURRENCY))
    wait(lambda: completed(rig, warm_id), warm.ok, 60 + jobs / 50, f"{label}: warm-up jobs", log)


def _e2e(rig: Rig, label: str, jobs: int, sampler: Sampler, log: Log) -> dict[str, Any]:
    """The e2e pass, and the dispatch rate it allows: half its rate, at most DISPATCH_RATE
    (a paced rate the stack can carry, or the dispatch figure is a queue's growth)."""
    url = f"{rig.procs['api'].url}/v1/jobs"
    _warm(rig, label, WARM_JOBS, log)

    tenant_id, key = rig.tenant(f"bench-e2e-{label}-{uuid.uuid4().hex[:6]}")
    own = ["api", "relay", "worker"]
    log(f"  {label}: {jobs} jobs end to end from {E2E_CONCURRENCY} connections")
    # Statements only: the steady run reads the tables' live and dead tuples afterwards.
    rig.statements_reset(tables=False)
    server0 = _server_counters(rig.database_url)
    phase = sampler.phase({**rig.pids(*own, "fake-provider"), **rig.infra_pids()})
    load = asyncio.run(loadgen.closed_loop(url, job_body(), {"Authorization": f"Bearer {key}"},
                                           total=jobs, concurrency=E2E_CONCURRENCY))
    wait(lambda: completed(rig, tenant_id), load.ok, 60 + jobs / 50, f"{label}: e2e jobs", log)
    sampler.end(phase)
    done, _first, last = calmq_span(rig, tenant_id)
    costs = process_costs(phase, own, done)
    server = _per_job(server0, _server_counters(rig.database_url), done)
    statements = rig.statements(done, top=25)

    jobs_per_s = done / max(last - load.started_at, 1e-3)
    return {"jobs_per_s": rounded(jobs_per_s), "completed": done,
            "dispatch_rate": min(DISPATCH_RATE, round(jobs_per_s / 2)),
            "submit_errors": sum(load.errors.values()),
            "pg_cpu_ms_per_job": costs.get("pg_cpu_ms_per_job", 0.0),
            "cpu_s_per_1000_jobs": costs["cpu_s_per_1000_jobs"],
            "pg_server_per_job": server, "pg_statements": statements}


# -- dispatch, taking turns -----------------------------------------------------------------------

def turns(pairs: int) -> list[str]:
    """The order of the dispatch runs: ``pairs`` pairs of one "empty" and one "preloaded"
    run, every other pair reversed (ABBA...), so each side runs first as often and a
    pair's two runs are next to each other."""
    order: list[str] = []
    for n in range(pairs):
        order += ["empty", "preloaded"] if n % 2 == 0 else ["preloaded", "empty"]
    return order


def paired_ratio(empty: list[float], preloaded: list[float]) -> float:
    """The median over the pairs of preloaded / empty: each pair's two runs are next to
    each other, so what drifts over the runs falls on both of a pair's runs; the median
    sets aside the pairs where one run met a stall of the host."""
    return rounded(statistics.median(_ratios(empty, preloaded)), 3)


def paired_interval(empty: list[float], preloaded: list[float],
                    resamples: int = 2000) -> tuple[float, float]:
    """A 95 % bootstrap interval of ``paired_ratio``: the pairs resampled with replacement
    (a fixed seed, so a result reads the same twice). How far the host's noise leaves the
    ratio open: the target means little where the interval is wider than it."""
    ratios = _ratios(empty, preloaded)
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(resamples))
    return (rounded(medians[int(resamples * 0.025)], 3),
            rounded(medians[int(resamples * 0.975) - 1], 3))


def _ratios(empty: list[float], preloaded: list[float]) -> list[float]:
    return [p / max(e, 1e-9) for e, p in zip(empty, preloaded, strict=True)]


def _drop_relay_slot(url: str, slot: str, log: Log, within: float = 30.0) -> None:
    """Drop ``slot`` and its record once its relay is gone (its walsender exits when the
    stopped relay's socket closes), so it keeps no WAL for the runs that follow."""
    from calmq.errors import ConfigError
    from calmq.relay import drop_slot

    deadline = time.monotonic() + within
    while True:
        try:
            drop_slot(url, slot)
            return
        except ConfigError as e:
            if time.monotonic() > deadline:
                raise
            log(f"  waiting for slot {slot} to be released: {e}")
            time.sleep(0.2)


def _switch(rig: Rig, fake_url: str, url: str, slot: str, label: str, log: Log) -> None:
    """The stack restarted on ``url``, warmed up."""
    for name in ("api", "relay", "worker"):
        rig.stop(name)
    rig.use_database(url, slot)
    _services(rig, fake_url)
    _warm(rig, label, DISPATCH_WARM_JOBS, log)


def _dispatch_turns(rig: Rig, fake_url: str, urls: dict[str, str], rate: float, pairs: int,
                    log: Log) -> dict[str, Any]:
    """Accept→dispatch runs at ``rate`` on both databases in pairs (see ``turns``), ending
    on the preloaded one's stack: each side's runs and median run, and the paired ratio."""
    slots = {"empty": EMPTY_SLOT, "preloaded": FULL_SLOT}
    each: dict[str, list[dict[str, float]]] = {"empty": [], "preloaded": []}
    current = "preloaded"
    for n, side in enumerate(turns(pairs)):
        if side != current:
            _switch(rig, fake_url, urls[side], slots[side], side, log)
            current = side
        url = f"{rig.procs['api'].url}/v1/jobs"
        before = _server_counters(rig.database_url)
        one = dispatch_runs(rig, url, 1, log, rate=rate, seconds=DISPATCH_TURN_SECONDS,
                            label=f"{side} (run {n + 1} of {2 * pairs})")
        after = _server_counters(rig.database_url)
        # The maintenance of this database that finished during the run (and its wait for
        # the run's jobs): what a stall of one run may be.
        for run in one["dispatch_each_run"]:
            run.update({k: after[k] - before[k]
                        for k in ("autovacuums", "autoanalyzes", "checkpoints")})
        each[side] += one["dispatch_each_run"]
    if current != "preloaded":
        _switch(rig, fake_url, urls["preloaded"], FULL_SLOT, "preloaded", log)
    out: dict[str, Any] = {}
    for side, passes in each.items():
        out[side] = {**median_run(passes), "dispatch_rate": rate, "dispatch_each_run": passes}
    p99s = [p["p99_ms"] for p in each["empty"]], [p["p99_ms"] for p in each["preloaded"]]
    out["p99_paired_ratio"] = paired_ratio(*p99s)
    out["p99_paired_interval"] = list(paired_interval(*p99s))
    out["p50_paired_ratio"] = paired_ratio([p["p50_ms"] for p in each["empty"]],
                                           [p["p50_ms"] for p in each["preloaded"]])
    return out


# -- reads ----------------------------------------------------------------------------------------

async def _timed(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                 n: int) -> dict[str, float]:
    """``n`` requests one after another, or as many as READ_SECONDS holds (at least
    READ_MIN): a read of seconds would otherwise take half an hour of the run (the console
    overview at 20 M: 200 x 8.4 s). ``requests`` says how many the percentiles are of."""
    took: list[float] = []
    deadline = time.perf_counter() + READ_SECONDS
    while len(took) < n and (len(took) < READ_MIN or time.perf_counter() < deadline):
        t = time.perf_counter()
        async with session.get(url, headers=headers, allow_redirects=False) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {url} answered {resp.status}")
        took.append((time.perf_counter() - t) * 1000)
    return {"p50_ms": rounded(percentile(took, 50), 2), "p99_ms": rounded(percentile(took, 99), 2),
            "requests": len(took)}


async def _console_cookie(session: aiohttp.ClientSession, base: str, key: str) -> str:
    """Sign in to the console as a browser does (the form's CSRF cookie and token)."""
    async with session.get(f"{base}/console/sign-in") as resp:
        page = await resp.text()
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    if match is None:
        raise RuntimeError("the console's sign-in form has no CSRF token")
    async with session.post(f"{base}/console/sign-in", allow_redirects=False,
                            data={"csrf": match.group(1), "api_key": key}) as resp:
        if resp.status != 303:
            raise RuntimeError(f"console sign-in answered {resp.status}")
    cookie = session.cookie_jar.filter_cookies(base).get("calmq_console")  # type: ignore[arg-type]
    if cookie is None:
        raise RuntimeError("console sign-in set no session cookie")
    return str(cookie.value)


async def _reads(base: str, big_key: str, small_key: str, ids: list[str],
                 value: str) -> dict[str, Any]:
    big = {"Authorization": f"Bearer {big_key}"}
    small = {"Authorization": f"Bearer {small_key}"}
    out: dict[str, Any] = {}
    # unsafe: keep cookies of an IP address host (the API listens on 127.0.0.1)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        took = []
        for job_id in ids:
            t = time.perf_counter()
            async with s.get(f"{base}/v1/jobs/{job_id}", headers=big) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"GET /v1/jobs/{job_id} answered {resp.status}")
            took.append((time.perf_counter() - t) * 1000)
        out["get_job"] = {"p50_ms": rounded(percentile(took, 50), 2),
                          "p99_ms": rounded(percentile(took, 99), 2)}
        out["list_largest"] = await _timed(s, f"{base}/v1/jobs?limit=50", big, READS)
        out["list_small"] = await _timed(s, f"{base}/v1/jobs?limit=50", small, READS)
        out["list_dead_letter_largest"] = await _timed(
            s, f"{base}/v1/jobs?status=dead_letter&limit=50", big, READS)
        out["list_dead_letter_small"] = await _timed(
            s, f"{base}/v1/jobs?status=dead_letter&limit=50", small, READS)
        cookie = await _console_cookie(s, base, big_key)
        session = {"Cookie": f"calmq_console={cookie}"}
        out["console_overview"] = await _timed(s, f"{base}/console/overview", session, READS)
        out["console_jobs"] = await _timed(s, f"{base}/console/jobs", session, READS)
        out["console_search_value"] = await _timed(
            s, f"{base}/console/jobs?q={urllib.parse.quote(value)}", session, READS)
    return out


def _read_targets(url: str) -> tuple[list[str], str]:
    """Job ids of the largest preloaded tenant (its newest 5,000, 200 picked) and a
    metadata value of one of its jobs (the console's search)."""
    import random

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT j.id, j.metadata->>'order' FROM jobs j JOIN tenants t ON t.id = j.tenant_id"
            " WHERE t.name = %s ORDER BY j.created_at DESC LIMIT 5000",
            (tenant_names()[0],)).fetchall()
    rng = random.Random(32)
    return [str(rng.choice(rows)[0]) for _ in range(READS)], str(rows[0][1])


def _dlq_summary(rig: Rig) -> dict[str, float]:
    """`calmq dlq summary` for all tenants, wall time of the CLI (3 runs: min and max)."""
    took = []
    for _ in range(3):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "calmq.cli", "dlq", "summary", "--json"],
                       env=rig.child_env(), check=True, capture_output=True, timeout=600)
        took.append(time.perf_counter() - t)
    return {"min_s": rounded(min(took), 3), "max_s": rounded(max(took), 3)}


async def _housekeeping(url: str) -> dict[str, Any]:
    """The reaper's and sweeper's passes as the processes run them (processors/reaper.py):
    their statements through the data layer, 20 passes each, p50/p99."""
    from calmq.data import Store
    from calmq.processors.reaper import POISON_ERROR

    store = Store(url, max_size=2)
    await store.open()
    try:
        passes = {
            "reaper_poisoned": lambda: store.jobs.dead_letter_poisoned(POISON_ERROR),
            "reaper_expired_leases": store.jobs.reap_expired_leases,
            "sweeper_stranded": lambda: store.jobs.sweep_stranded(300.0, 3600.0),
        }
        out: dict[str, Any] = {}
        for name, run in passes.items():
            took = []
            for _ in range(20):
                t = time.perf_counter()
                await run()
                took.append((time.perf_counter() - t) * 1000)
            out[name] = {"p50_ms": rounded(percentile(took, 50), 2),
                         "p99_ms": rounded(percentile(took, 99), 2)}
        return out
    finally:
        await store.close()


# -- the steady run -------------------------------------------------------------------------------

def _retired(api_url: str) -> float:
    return scrape(api_url).value("calmq_retention_jobs_retired_total")


def _past_retention(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM jobs WHERE redacted_at IS NULL"
            " AND status IN ('completed', 'dead_letter', 'cancelled')"
            " AND created_at < now() - make_interval(days => %(d)s)"
            " AND updated_at < now() - make_interval(days => %(d)s)",
            {"d": RETENTION_DAYS}).fetchone()
    return int(row[0]) if row else 0


def _steady(rig: Rig, fake_url: str, seconds: float, sampler: Sampler,
            log: Log) -> dict[str, Any]:
    """Intake at INTAKE_RATE for ``seconds`` beside the API's retention sweep."""
    url = rig.database_url
    rig.stop("api")
    rig.calmq("api", env={"CALMQ_FAKE_PROVIDER_URL": fake_url,
                          "CALMQ_JOB_RETENTION_SECONDS": str(RETENTION_DAYS * 86400)})
    api = rig.procs["api"].url
    before = _tables(url)
    eligible = _past_retention(url)
    tenant_id, key = rig.tenant(f"bench-steady-{uuid.uuid4().hex[:6]}")
    log(f"  steady: {INTAKE_RATE:.0f} jobs/s for {seconds:.0f} s beside retention "
        f"({eligible} jobs past {RETENTION_DAYS} days)")
    retired0 = _retired(api)  # since the API's start: its sweep began then
    own = ["api", "relay", "worker"]
    phase = sampler.phase({**rig.pids(*own, "fake-provider"), **rig.infra_pids()})
    t0 = time.monotonic()
    load = asyncio.run(loadgen.open_loop(f"{api}/v1/jobs", job_body(),
                                         {"Authorization": f"Bearer {key}"},
                                         rate=INTAKE_RATE, seconds=seconds))
    retired = _retired(api) - retired0
    window = time.monotonic() - t0
    # The API's counter moves once per sweep pass (up to ten minutes long), so what the
    # window retired is read from the database too: the jobs past retention it left (few
    # preloaded jobs cross the 20 days within a window: the preload spreads 30 days).
    by_database = eligible - _past_retention(url)
    # A host slower than the intake leaves a backlog: its drain is waited for, not timed.
    done = wait(count_completed(rig, tenant_id), load.ok, 120 + load.ok / 100, "steady jobs",
                log)
    sampler.end(phase)
    after = _tables(url)
    left = _past_retention(url)
    return {"seconds": rounded(window), "intake_per_s": rounded(load.rate),
            "submitted": load.ok, "submit_errors": sum(load.errors.values()),
            "submit_error_kinds": dict(load.errors),  # status codes, or the client's error
            "completed": done, "retired": int(max(retired, by_database)),
            "retired_before_intake": int(retired0),
            "retired_per_s": rounded(max(retired, by_database) / max(window, 1e-3)),
            "retired_by_counter": int(retired), "retired_by_database": by_database,
            "past_retention_before": eligible, "past_retention_after": left,
            "pg_cpu_ms_per_job": process_costs(phase, own, max(done, 1)).get(
                "pg_cpu_ms_per_job", 0.0),
            "tables_before": before, "tables_after": after}


# -- the scenario ---------------------------------------------------------------------------------

def scale(size: int, log: Log, sampler: Sampler, runs: int = DISPATCH_PAIRS,
          steady_seconds: float | None = None, **_: Any) -> dict[str, Any]:
    """``runs``: the dispatch runs a database (in pairs, see ``turns``)."""
    steady = steady_seconds if steady_seconds is not None else (
        FULL_STEADY_SECONDS if size >= SMOKE_BELOW else SMOKE_STEADY_SECONDS)
    with Rig(log=log, postgres_settings=_LOAD_SETTINGS) as rig:
        empty_url = rig.database_url
        full_url = rig.add_database("calmq_scale")
        # The fake answers without checking each request against the SDKs' types: the
        # check costs CPU per call on the same two cores, which this scenario does not
        # measure (tests/integration/test_provider_shapes.py does).
        fake = rig.calmq("fake-provider", "--no-check-requests").url
        _services(rig, fake)
        empty = _e2e(rig, "empty", E2E_JOBS, sampler, log)
        for name in ("api", "relay", "worker"):
            rig.stop(name)
        # Its slot would keep the preload's WAL. Its outbox rows were published: cleared,
        # so the relay that starts on this database again has nothing to catch up.
        _drop_relay_slot(empty_url, rig.env.get("CALMQ_RELAY_SLOT", "calmq_outbox"), log)
        with psycopg.connect(empty_url, autocommit=True) as conn:
            conn.execute("TRUNCATE outbox")

        # Loaded with no slot on the server, so the load's WAL is nobody's to decode.
        log(f"  preloading {size} jobs into calmq_scale")
        t = time.monotonic()
        loaded = preload(full_url, size, log=log)
        preload_s = time.monotonic() - t
        preloaded_mb = _database_mb(full_url)
        _autovacuum_quiet(full_url, log)

        rig.use_database(full_url, FULL_SLOT)
        _services(rig, fake)
        full = _e2e(rig, "preloaded", E2E_JOBS, sampler, log)
        dispatch = _dispatch_turns(rig, fake, {"empty": empty_url, "preloaded": full_url},
                                   empty["dispatch_rate"], runs, log)
        empty.update(dispatch["empty"])
        full.update(dispatch["preloaded"])
        full["dispatch_p99_paired_ratio"] = dispatch["p99_paired_ratio"]
        full["dispatch_p99_paired_interval_95"] = dispatch["p99_paired_interval"]
        full["dispatch_p50_paired_ratio"] = dispatch["p50_paired_ratio"]
        _drop_relay_slot(empty_url, EMPTY_SLOT, log)  # no WAL kept through the steady run
        names = tenant_names()
        from calmq.data import tenants

        big_key = tenants.add_key(full_url, names[0])
        small_key = tenants.add_key(full_url, names[-1])
        ids, value = _read_targets(full_url)
        log("  preloaded: reads over HTTP, the DLQ summary and housekeeping passes")
        reads = asyncio.run(_reads(rig.procs["api"].url, big_key, small_key, ids, value))
        dlq = _dlq_summary(rig)
        housekeeping = asyncio.run(_housekeeping(full_url))
        steady_run = _steady(rig, fake, steady, sampler, log)
        versions = rig.versions

    first_pages = [reads[k]["p99_ms"] for k in ("list_largest", "console_jobs")]
    after = steady_run["tables_after"]
    hot = {t: after[t]["dead_ratio"] for t in ("jobs", "job_events", "job_attempts", "outbox")
           if t in after}
    targets = {
        "e2e_jobs_per_s_vs_empty_ge_0.9": ratio(full["jobs_per_s"], empty["jobs_per_s"]) >= 0.9,
        "dispatch_p99_vs_empty_le_1.2": full["dispatch_p99_paired_ratio"] <= 1.2,
        "largest_first_page_p99_le_50_ms": max(first_pages) <= 50,
        "pg_cpu_per_job_vs_empty_le_1.1":
            ratio(full["pg_cpu_ms_per_job"], empty["pg_cpu_ms_per_job"]) <= 1.1,
        "retention_retires_at_least_intake":
            steady_run["retired_per_s"] >= steady_run["intake_per_s"],
        "hot_tables_dead_ratio_le_0.2": max(hot.values(), default=0.0) <= 0.2,
    }
    figures = {
        "preloaded_jobs": loaded.jobs, "preload_s": rounded(preload_s),
        "preload_jobs_per_s": rounded(loaded.jobs / max(preload_s, 1e-3)),
        "preloaded_database_mb": preloaded_mb,
        "jobs_per_s": full["jobs_per_s"], "dispatch_p50_ms": full["dispatch_p50_ms"],
        "dispatch_p99_ms": full["dispatch_p99_ms"],
        "pg_cpu_ms_per_job": full["pg_cpu_ms_per_job"],
        "reads": reads, "dlq_summary": dlq, "housekeeping": housekeeping,
        "steady": steady_run, "hot_tables_dead_ratio_after": hot,
        "statement_growth": _statement_growth(empty["pg_statements"], full["pg_statements"]),
        "targets": targets, "preload": loaded.as_dict(), "preloaded_e2e": full,
    }
    res = result("scale", size, figures, {"empty_database": empty}, {
        "jobs_per_s_vs_empty": ratio(full["jobs_per_s"], empty["jobs_per_s"]),
        # The pairs' median ratio (see paired_ratio), not the ratio of the two medians.
        "dispatch_p99_ms_vs_empty": full["dispatch_p99_paired_ratio"],
        "pg_cpu_ms_per_job_vs_empty": ratio(full["pg_cpu_ms_per_job"],
                                         empty["pg_cpu_ms_per_job"]),
        "retired_per_s_vs_intake": ratio(steady_run["retired_per_s"],
                                         steady_run["intake_per_s"]),
    }, versions, extra_versions={"load_generator": loadgen.NAME})
    res["steady_seconds"] = steady
    json.dumps(res)  # every figure is plain JSON (the CLI prints it)
    return res
