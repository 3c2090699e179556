"""The ordinary path's history as rows, against none (issue 32): PostgreSQL's work per job
for the three events a job that simply completes writes (``queued``, ``running``,
``completed``), so whether to read them from the job's own columns is decided on a figure.

Each job goes through calmq's own statements, as the API and the worker run them: the
API's group commit (``insert_jobs``), the worker's claim (``claim_jobs``) and its group
commit of finished attempts (``finish_attempts``: a completed outcome, its usage and its
result event), in groups of ``GROUP``, on the rig's database with nothing else running.

- ``rows``: today. Each of the three statements inserts the job's event into
  ``job_events``, and the history trigger runs for it.
- ``columns``: the same statements, with a BEFORE INSERT trigger on ``job_events`` that
  drops the three ordinary events (returns NULL), as if their times were read from the
  job's row. What that saves: the event's heap tuple, its two index entries, its WAL, the
  history trigger's work for it, and its share of the vacuum each pass ends with.

``rows`` runs with a BEFORE trigger too, one that lets every event through, so both pay the
same trigger call and the difference is the rows alone. The saving is an upper bound: the
real change would move the completed event's webhook delivery, its finished-jobs bin and
its NOTIFY to a trigger on ``jobs``, and the API and the console would read a job's history
from two places.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from statistics import median
from typing import Any

import psycopg

from bench.common import Log, ratio, rounded
from bench.procs import Sampler
from bench.report import result
from bench.rig import Rig
from calmq import events, topics
from calmq.data import Store
from calmq.data.attempts import Finish
from calmq.data.jobs import Job, NewJob, insert_jobs
from calmq.data.outbox import entry
from calmq.jobs import EventType, Status, new_id

__all__ = ["happy_path"]

GROUP = 20  # the jobs of one group commit: the API's insert, the worker's claim and finish
ROUNDS = 5  # measured passes of each variant, alternating
WORKER = "bench-happy-path"
_ORDINARY = ("queued", "running", "completed")

_KEEP = """
CREATE OR REPLACE FUNCTION bench_happy_path() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.type IN ('queued', 'running', 'completed') AND false THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END $$"""
# The same function but for the one constant: both variants test the event's type.
_DROP = _KEEP.replace("AND false THEN", "AND true THEN")
_TRIGGER = ("CREATE TRIGGER bench_happy_path BEFORE INSERT ON job_events "
            "FOR EACH ROW EXECUTE FUNCTION bench_happy_path()")


def _completed(job: Job) -> Finish:
    """The worker's Finish for an attempt that completed (calmq/workflows/progress.py)."""
    artifact = {"uri": f"file:///bench/artifacts/{job.id}.json", "sha256": "0" * 64,
                "content_type": "application/json", "size": 96}
    usage = {"model_calls": 1, "input_tokens": 120, "output_tokens": 40, "cost_usd": 0.00012}
    return Finish(
        job_id=job.id, worker=WORKER, step=job.step, attempt=job.attempt,
        lease_version=job.lease_version, outcome="completed", status=Status.COMPLETED,
        event_type=EventType.COMPLETED, artifact=artifact,
        event_detail={"artifact": artifact["uri"], "input_tokens": 120, "output_tokens": 40},
        usage=usage,
        outbox=[entry(topics.RESULTS_ROUTE, "job.result",
                      events.result(job, Status.COMPLETED, artifact=artifact), key=job.id,
                      trace_parent=job.trace_parent)])


async def _run_jobs(url: str, tenant_id: uuid.UUID, jobs: int) -> float:
    """``jobs`` jobs submitted, claimed and completed in groups; returns the seconds taken."""
    store = Store(url, max_size=2)
    await store.open()
    try:
        started = time.perf_counter()
        for _ in range(0, jobs, GROUP):
            new = [NewJob(id=new_id(), tenant_id=tenant_id, workflow="summarize",
                          workflow_version=1, priority="bulk", pool="default",
                          step="summarize", max_attempts=5,
                          input={"text": "Kafka and PostgreSQL carry slow AI jobs.",
                                 "mode": "success"})
                   for _ in range(GROUP)]
            async with store.pool.connection() as conn:
                await insert_jobs(conn, new)
            claimed = await store.jobs.claim([j.id for j in new], WORKER, 60.0)
            moved = await store.attempts.finish([_completed(j) for j in claimed])
            if len(moved) != len(new):
                raise RuntimeError(f"{len(new) - len(moved)} of {len(new)} jobs not completed")
        return time.perf_counter() - started
    finally:
        await store.close()


def _variant(rig: Rig, sampler: Sampler, name: str, jobs: int, log: Log) -> dict[str, Any]:
    tenant_id = uuid.UUID(rig.tenant(f"bench-happy-{name}-{uuid.uuid4().hex[:6]}")[0])
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        conn.execute((_DROP if name == "columns" else _KEEP).encode())
        lsn0 = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
    log(f"  {name}: {jobs} jobs in groups of {GROUP}")
    phase = sampler.phase(rig.infra_pids())
    seconds = asyncio.run(_run_jobs(rig.database_url, tenant_id, jobs))
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        # Each pass pays for its own clean-up: the dead versions of the job rows' updates,
        # the visibility of the rows it inserted. Autovacuum is off, so none of it falls
        # on the next pass.
        conn.execute("VACUUM jobs, job_events, job_attempts, outbox")
    sampler.end(phase)
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        wal = int(conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)",
                               (lsn0,)).fetchone()[0])  # type: ignore[index]
        written = conn.execute(
            "SELECT count(*) FILTER (WHERE e.type = ANY(%s)), count(*) FROM job_events e "
            "JOIN jobs j ON j.id = e.job_id WHERE j.tenant_id = %s",
            (list(_ORDINARY), tenant_id)).fetchone()
        done = conn.execute("SELECT count(*) FROM jobs WHERE tenant_id = %s AND status = %s",
                            (tenant_id, Status.COMPLETED.value)).fetchone()
    assert written is not None
    assert done is not None
    if int(done[0]) != jobs:
        raise RuntimeError(f"{name}: {done[0]} of {jobs} jobs completed")
    pg = phase.cpu.get("postgres", 0.0)
    return {"pg_cpu_ms_per_job": rounded(pg * 1000 / jobs, 4),
            "jobs_per_s": rounded(jobs / max(seconds, 1e-6)),
            "wal_bytes_per_job": rounded(wal / jobs),
            "history_rows_per_job": rounded(int(written[1]) / jobs, 2),
            "ordinary_rows_per_job": rounded(int(written[0]) / jobs, 2)}


def happy_path(size: int, log: Log, sampler: Sampler, **_: Any) -> dict[str, Any]:
    size = max(GROUP, size - size % GROUP)
    with Rig(log=log) as rig:
        with psycopg.connect(rig.database_url, autocommit=True) as conn:
            conn.execute(_KEEP.encode())
            conn.execute(_TRIGGER.encode())
            # Vacuum runs at the end of each pass instead (_variant): autovacuum's runs fell
            # on whichever pass was under way and spread the passes of one variant 0.29 to
            # 0.69 ms per job.
            conn.execute("ALTER SYSTEM SET autovacuum = off")
            conn.execute("SELECT pg_reload_conf()")
        # Once each first, unmeasured (first executions plan; the caches are cold), then
        # alternating, so a drift of the machine falls on both.
        for name in ("rows", "columns"):
            _variant(rig, sampler, name, max(GROUP, size // 10 - size // 10 % GROUP),
                     lambda _m: None)
        passes: dict[str, list[dict[str, Any]]] = {"rows": [], "columns": []}
        for _round in range(ROUNDS):
            for name in ("rows", "columns"):
                passes[name].append(_variant(rig, sampler, name, size, log))
        versions = rig.versions

    def summary(name: str) -> dict[str, Any]:
        runs = passes[name]
        return {**runs[-1],
                "pg_cpu_ms_per_job": median(r["pg_cpu_ms_per_job"] for r in runs),
                "jobs_per_s": median(r["jobs_per_s"] for r in runs),
                "wal_bytes_per_job": median(r["wal_bytes_per_job"] for r in runs),
                "pg_cpu_ms_per_job_each_run": [r["pg_cpu_ms_per_job"] for r in runs]}

    rows, columns = summary("rows"), summary("columns")
    return result("happy_path", size, columns, {"history_rows": rows},
                  {"pg_cpu_per_job_vs_history_rows": ratio(columns["pg_cpu_ms_per_job"],
                                                           rows["pg_cpu_ms_per_job"]),
                   "wal_bytes_per_job_vs_history_rows": ratio(columns["wal_bytes_per_job"],
                                                              rows["wal_bytes_per_job"])},
                  versions)
