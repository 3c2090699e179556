"""`calmq migrate` against a fresh database: dry run, apply, idempotence, two at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from calmq import sql
from calmq.data.migrations import LOCK_ID
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

ALL = [(v, n) for v, n, _ in sql.migrations()]



def _env(url: str) -> dict[str, str]:
    # Only the database: the command must not need Kafka, the registry or a running stack.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    env["CALMQ_DATABASE_URL"] = url
    return env


def _argv(tmp_path: Path, *args: str) -> list[str]:
    # An empty --data-dir: no local stack to borrow settings from.
    return [sys.executable, "-m", "calmq.cli", "migrate", "--data-dir", str(tmp_path), *args]


def _run(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_argv(tmp_path, *args), env=_env(url), capture_output=True,
                          text=True, timeout=60, check=False)


def _recorded(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        if conn.execute("SELECT to_regclass('calmq_migrations')").fetchone() == (None,):
            return []
        return [(r[0], r[1]) for r in
                conn.execute("SELECT version, name FROM calmq_migrations ORDER BY version")]


def _tables(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
                           ).fetchone()
    assert row is not None
    return int(row[0])


def _pairs(rows: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(r["version"], r["name"]) for r in rows]


def test_dry_run_lists_every_migration_and_writes_nothing(fresh_db: str, tmp_path: Path) -> None:
    done = _run(fresh_db, tmp_path, "--dry-run", "-o", "json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert _pairs(rows) == ALL
    assert {r["status"] for r in rows} == {"pending"}
    assert _tables(fresh_db) == 0  # not even the bookkeeping table

    table = _run(fresh_db, tmp_path, "--dry-run")
    assert table.returncode == 0, table.stderr
    assert f"would apply {len(ALL)} migration(s)" in table.stdout
    assert _tables(fresh_db) == 0


def test_apply_then_a_second_apply_is_a_no_op(fresh_db: str, tmp_path: Path) -> None:
    first = _run(fresh_db, tmp_path, "-o", "jsonl")
    assert first.returncode == 0, first.stderr
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    assert _pairs(rows) == ALL
    assert {r["status"] for r in rows} == {"applied"}
    assert _recorded(fresh_db) == ALL

    again = _run(fresh_db, tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("database is up to date")
    assert _recorded(fresh_db) == ALL
    dry = _run(fresh_db, tmp_path, "--dry-run", "-o", "json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout) == []


def test_two_concurrent_migrations_both_succeed_and_apply_each_migration_once(
        fresh_db: str, tmp_path: Path) -> None:
    """The test holds the lock until both processes wait on it, so they really contend."""
    with psycopg.connect(fresh_db, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (LOCK_ID,))
        procs = [subprocess.Popen(_argv(tmp_path, "-o", "json"), env=_env(fresh_db),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        try:
            def both_waiting() -> bool:
                # A migrator that found the lock taken asks for it again and again
                # (pg_try_advisory_lock: calmq.data.migrations says why it never blocks in
                # pg_advisory_lock); one whose last statement was that ask is waiting.
                row = holder.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND pid <> pg_backend_pid() AND query LIKE '%pg_try_advisory_lock%'"
                ).fetchone()
                return row is not None and row[0] == 2

            wait_for(both_waiting, timeout=30, what="both migrations waiting on the lock")
        finally:
            holder.execute("SELECT pg_advisory_unlock(%s)", (LOCK_ID,))
        outs = [p.communicate(timeout=60) for p in procs]
    for proc, (_out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err
        assert "another process is migrating" in err
    applied = sorted((_pairs(json.loads(out)) for out, _ in outs), key=len)
    assert applied == [[], ALL]  # one applied everything, the other found nothing to do
    assert _recorded(fresh_db) == ALL


def test_a_database_migrated_by_a_newer_release_is_up_to_date_with_a_note(
        fresh_db: str, tmp_path: Path) -> None:
    """An older calmq (a rollback) applies nothing, exits 0, and names the newer versions."""
    assert _run(fresh_db, tmp_path).returncode == 0
    with psycopg.connect(fresh_db) as conn:
        conn.execute("INSERT INTO calmq_migrations (version, name) VALUES (9999, 'future')")
    again = _run(fresh_db, tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("database is up to date")
    assert "migration(s) 9999 that this calmq does not ship" in again.stderr
