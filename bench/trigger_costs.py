"""What each trigger on the happy path costs PostgreSQL per row (issue 48).

    python -m bench.trigger_costs postgresql://postgres@127.0.0.1:5432/calmq [--rows 1000]

The same statement with the trigger enabled and with it disabled, each in a transaction that
is rolled back (nothing is left in the database; it must be migrated and hold no tenant
with a results topic), alternating, five times; the figure is the backend's on-CPU time
(/proc/<pid>/schedstat, so the server must run on this machine) per row, the median.
On-CPU time, not wall time: on a shared host the wall time of a statement is mostly the
time it waited for a core.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import psycopg

__all__ = ["CASES", "main", "measure"]

_SEED = [
    "SELECT calmq_history_partitions(interval '2 days', interval '1 day')",
    "INSERT INTO tenants (id, name) VALUES ('00000000-0000-4000-8000-000000000048', "
    "'bench-trigger-costs')",
    "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool, "
    "step, max_attempts, lease_owner, lease_version) SELECT gen_random_uuid(), "
    "'00000000-0000-4000-8000-000000000048', 'summarize', 1, 'running', 'bulk', 'default', "
    "'s', 3, 'w', 1 FROM generate_series(1, %(rows)s)",
    "INSERT INTO job_attempts (job_id, step, attempt, worker, started_at) SELECT id, 's', 1, "
    "'w', now() FROM jobs WHERE tenant_id = '00000000-0000-4000-8000-000000000048'",
]
_MINE = "tenant_id = '00000000-0000-4000-8000-000000000048'"

# name -> (table, trigger, the statement it fires on, one row per job)
CASES: dict[str, tuple[str, str, str]] = {
    "outbox_tenant_route (a job.result row)": (
        "outbox", "outbox_tenant_route",
        "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload) SELECT "
        "gen_random_uuid(), 'results', j.id::text, 'job.result', jsonb_build_object("
        "'tenant_id', j.tenant_id::text, 'job_id', j.id::text, 'status', 'completed') "
        f"FROM jobs j WHERE j.{_MINE}"),
    "jobs_settle_child (an UPDATE of jobs)": (
        "jobs", "jobs_settle_child",
        "UPDATE jobs SET status = 'completed', lease_owner = NULL, updated_at = now() "
        f"WHERE {_MINE}"),
    "job_attempts_spend (an attempt's cost written)": (
        "job_attempts", "job_attempts_spend",
        "UPDATE job_attempts a SET finished_at = now(), outcome = 'completed', "
        "cost_usd = a.cost_usd + 0.001, input_tokens = a.input_tokens + 100 FROM jobs j "
        f"WHERE j.id = a.job_id AND j.{_MINE}"),
    "job_events_notify (a completed event)": (
        "job_events", "job_events_notify",
        "INSERT INTO job_events (job_id, type, attempt, detail) SELECT id, 'completed', 1, "
        f"'{{}}' FROM jobs WHERE {_MINE}"),
}


def _on_cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def measure(conn: psycopg.Connection[Any], table: str, trigger: str, statement: str,
            rows: int, *, enabled: bool) -> float:
    """On-CPU microseconds per row of ``statement`` (run twice: the first warms)."""
    pid = conn.info.backend_pid
    with conn.transaction(force_rollback=True):
        for seed in _SEED:
            conn.execute(seed.replace("%(rows)s", str(rows)).encode())
        if not enabled:
            conn.execute(f"ALTER TABLE {table} DISABLE TRIGGER {trigger}".encode())
        conn.execute(statement.encode())
        started = _on_cpu_ns(pid)
        conn.execute(statement.encode())
        return (_on_cpu_ns(pid) - started) / rows / 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("database_url")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with psycopg.connect(args.database_url, autocommit=True) as conn:
        print("| trigger | with (us a row) | without | the trigger |\n|---|---:|---:|---:|")
        for name, (table, trigger, statement) in CASES.items():
            runs: dict[bool, list[float]] = {True: [], False: []}
            for i in range(args.repeats):
                for enabled in ((True, False) if i % 2 else (False, True)):
                    runs[enabled].append(measure(conn, table, trigger, statement, args.rows,
                                                 enabled=enabled))
            on, off = statistics.median(runs[True]), statistics.median(runs[False])
            print(f"| {name} | {on:.1f} | {off:.1f} | {on - off:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
