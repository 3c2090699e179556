"""Probes of a preloaded database (bench/preload.py), each against a PostgreSQL of its own
started from the embedded binaries, with nothing else running:

- ``migration SIZE``: a database at the schema before 0029, preloaded in the legacy layout,
  then 0029-0032 applied one by one: each one's time (0029's and 0032's are the only ones
  that take ACCESS EXCLUSIVE: their whole transaction bounds the lock), and the rows of
  jobs, job_events and job_attempts counted before and after;
- ``load SIZE``: the partitioned layout preloaded, then ``reads`` and ``retire`` below; the
  server stays up (its URL printed) for more probes;
- ``reads URL``: p50/p99 of the API's, console's and CLI's reads for the largest tenant and
  a small one (statement time seen by a client on the same machine);
- ``retire URL DAYS SECONDS``: one retention sweep pass with a retention of DAYS, at most
  SECONDS long: jobs retired per second and partitions dropped.

Not a ``calmq bench`` scenario yet (no intake at the same time, no ratio against an empty
database): the figures in BENCHMARKS.md ("Month six") say what they cover.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from bench.preload import preload
from calmq import sql
from calmq.data import Store
from calmq.data import migrations as migrating
from calmq.data.console import search_terms
from calmq.objects import open_object_store
from calmq.producers.retention import Sweeper
from calmq.settings import Settings
from calmq.tooling.devstack.postgres import PostgresServer

__all__ = ["migration", "reads", "retire", "server"]


def server(home: Path) -> PostgresServer:
    """A fresh PostgreSQL with a calmq database, sized for bulk loads (WAL and checkpoints)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pg = PostgresServer(home, port, settings={"max_wal_size": "8GB",
                                              "checkpoint_timeout": "30min"})
    pid = pg.start()
    print(f"postgres pid {pid} at {pg.url}", flush=True)
    deadline = time.monotonic() + 120
    while not pg.ready():
        if time.monotonic() > deadline:
            raise SystemExit("PostgreSQL did not start")
        time.sleep(0.2)  # poll
    pg.create_database()
    return pg


def _counts(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        rows = [conn.execute(f"SELECT count(*) FROM {t}".encode()).fetchone()
                for t in ("jobs", "job_events", "job_attempts")]
    return [int(r[0]) if r is not None else -1 for r in rows]


def migration(size: int, home: Path) -> dict[str, Any]:
    url = server(home).url
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE calmq_migrations (version integer PRIMARY KEY,"
                     " name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")
        for version, name, text in sql.migrations():
            if version < 29:
                with conn.transaction():
                    conn.execute(text.encode())
                    conn.execute("INSERT INTO calmq_migrations VALUES (%s, %s)",
                                 (version, name))
    loaded = preload(url, size, layout="legacy")
    before = _counts(url)
    took: dict[str, float] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        for version, name, text in sql.migrations():
            if version >= 29:
                t = time.monotonic()
                migrating._apply(conn, version, name, text)
                took[f"{version:04d}_{name}"] = round(time.monotonic() - t, 3)
    after = _counts(url)
    return {"size": size, "preload": loaded.as_dict(), "migration_seconds": took,
            "rows_before": before, "rows_after": after}


def _timed(conn: psycopg.Connection[Any], statement: str,
           params: Callable[[int], dict[str, Any]], n: int) -> dict[str, float]:
    took = []
    for i in range(n):
        t = time.perf_counter()
        conn.execute(statement.encode(), params(i)).fetchall()
        took.append((time.perf_counter() - t) * 1000)
    took.sort()
    return {"p50_ms": round(took[len(took) // 2], 2),
            "p99_ms": round(took[max(0, int(len(took) * 0.99) - 1)], 2), "n": n}


def reads(url: str, n: int = 200) -> dict[str, Any]:
    q = sql.queries()
    rng = random.Random(7)
    with psycopg.connect(url, row_factory=dict_row, autocommit=True) as c:
        big = c.execute("SELECT id FROM tenants WHERE name = 'scale-00'").fetchone()
        small = c.execute("SELECT id FROM tenants WHERE name = 'scale-49'").fetchone()
        if big is None or small is None:
            raise SystemExit("not a preloaded database (bench/preload.py)")
        ids = [r["id"] for r in c.execute(
            "SELECT id FROM jobs WHERE tenant_id = %s ORDER BY created_at DESC LIMIT 5000",
            (big["id"],))]
        picks = [rng.choice(ids) for _ in range(n)]
        value_row = c.execute("SELECT metadata->>'order' AS v FROM jobs WHERE tenant_id = %s"
                              " LIMIT 1", (big["id"],)).fetchone()
        assert value_row is not None
        value = str(value_row["v"])
        prefix = str(picks[0])[:8]
        listing = {"statuses": None, "workflow": None, "created_after": None,
                   "created_before": None, "cursor_at": None, "cursor_id": None, "limit": 50}
        console = {"statuses": None, "workflow": None, "pool": None, "priority": None,
                   "lane": None, "created_after": None, "created_before": None,
                   "search": None, "limit": 100, **search_terms(None)}
        dlq = {"tenant": None, "failure_class": None, "code": None, "workflow": None,
               "since": None, "until": None}

        def fixed(params: dict[str, Any]) -> Callable[[int], dict[str, Any]]:
            return lambda _i: params

        return {
            "get_job": _timed(c, q["job_for_tenant"],
                              lambda i: {"id": picks[i], "tenant_id": big["id"]}, n),
            "get_job_events": _timed(c, q["job_events"], lambda i: {"id": picks[i]}, n),
            "list_dead_letter_largest": _timed(c, q["list_jobs"], fixed(
                {**listing, "tenant_id": big["id"], "statuses": ["dead_letter"]}), n),
            "list_dead_letter_small": _timed(c, q["list_jobs"], fixed(
                {**listing, "tenant_id": small["id"], "statuses": ["dead_letter"]}), n),
            "list_largest": _timed(c, q["list_jobs"], fixed(
                {**listing, "tenant_id": big["id"]}), n),
            "console_jobs_largest": _timed(c, q["console_jobs"], fixed(
                {**console, "tenant_id": big["id"]}), n),
            "console_search_value_largest": _timed(c, q["console_jobs"], fixed(
                {**console, "tenant_id": big["id"], "search": value,
                 **search_terms(value)}), n),
            "console_search_id_prefix_largest": _timed(c, q["console_jobs"], fixed(
                {**console, "tenant_id": big["id"], "search": prefix,
                 **search_terms(prefix)}), n),
            "console_backlog_largest": _timed(c, q["console_backlog"], fixed(
                {"tenant_id": big["id"]}), n),
            "console_outcomes_largest": _timed(c, q["console_outcomes"], fixed(
                {"tenant_id": big["id"]}), n),
            "console_spend_largest": _timed(c, q["console_spend"], fixed(
                {"tenant_id": big["id"]}), n),
            "console_spend_all_tenants": _timed(c, q["console_spend"], fixed(
                {"tenant_id": None}), n),
            "dlq_summary_all_tenants": _timed(c, q["dlq_summary"], fixed(
                {**dlq, "tenant_id": None}), 5),
        }


async def _retire(url: str, days: float, seconds: float) -> dict[str, Any]:
    objects = Path(tempfile.mkdtemp(prefix="scale-objects-")).as_uri()
    settings = Settings(database_url=url, object_store_url=objects,
                        job_retention_seconds=days * 86400)
    store = Store(url, max_size=4)
    await store.open()
    try:
        sweeper = Sweeper(settings, store, open_object_store(objects))
        sweeper.pass_seconds = seconds
        t = time.monotonic()
        swept = await sweeper.sweep()
        wall = time.monotonic() - t
    finally:
        await store.close()
    return {**swept, "seconds": round(wall, 1), "jobs_per_s": round(swept["jobs"] / wall)}


def retire(url: str, days: float, seconds: float) -> dict[str, Any]:
    return asyncio.run(_retire(url, days, seconds))


def main() -> None:
    what, *args = sys.argv[1:]
    if what == "migration":
        home = Path(tempfile.mkdtemp(prefix="calmq-scale-migration-"))
        print(json.dumps(migration(int(args[0]), home)))
    elif what == "load":
        pg = server(Path(tempfile.mkdtemp(prefix="calmq-scale-")))
        migrating.apply_pending(pg.url)
        t = time.monotonic()
        loaded = preload(pg.url, int(args[0]))
        wall = time.monotonic() - t
        print(json.dumps({"preload": loaded.as_dict(),
                          "jobs_per_s": round(int(args[0]) / wall)}))
        print(json.dumps({"reads": reads(pg.url)}))
        print(json.dumps({"retire": retire(pg.url, 20, 120)}))
        print(f"PostgreSQL left running at {pg.url}")
    elif what == "reads":
        print(json.dumps(reads(args[0])))
    elif what == "retire":
        print(json.dumps(retire(args[0], float(args[1]), float(args[2]))))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
