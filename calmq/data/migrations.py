"""Apply the numbered migrations in calmq/sql/migrations, each once, in order.

Every writer takes one PostgreSQL advisory lock first, so that any number of processes
migrating at once (two `calmq migrate` Jobs, a Job and `calmq dev up`) apply each migration
exactly once: the second waits, then finds nothing left to do. A migration and its row in
``calmq_migrations`` commit in one transaction, so a crash leaves it either applied and
recorded or neither.

Two kinds of file (docs/how-to/production-checklist.md, "Migrations on a large database"):

- a plain file runs in one transaction. A file that takes a strong lock on a busy table sets
  ``SET LOCAL lock_timeout`` first: waiting for the lock behind a long transaction would
  queue every reader and writer of the table behind it. A migration that gives up on its
  lock (``lock_not_available``) is rolled back and tried again, a few times, after a pause;
- a file whose first line is ``-- calmq: no-transaction`` runs its statements one by one,
  outside a transaction: ``CREATE INDEX CONCURRENTLY`` (no lock that stops writes while the
  index is built) cannot run inside one. Its statements end with ``;`` at the end of a line
  and must be safe to run again (``IF NOT EXISTS``, ``IF EXISTS``): a crash half way leaves
  the earlier ones applied and the file unrecorded, and the next run repeats it. An index a
  failed ``CREATE INDEX CONCURRENTLY`` left invalid is dropped before it is built again.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors

from calmq import sql
from calmq.errors import InfrastructureError

__all__ = ["LOCK_ID", "NO_TRANSACTION", "Migration", "applied", "apply_pending", "migrate",
           "pending", "statements", "unknown"]

# The advisory lock's key ("calmq" in ASCII): one name for every process that migrates.
LOCK_ID = 0x63616C6D71

# The first line of a migration that runs statement by statement, outside a transaction.
NO_TRANSACTION = "-- calmq: no-transaction"

# How often a migration that gave up waiting for its lock is tried again, and the pause
# before each try (seconds): the long transaction it waited behind has usually ended.
LOCK_TRIES = 5
LOCK_PAUSE = 2.0
# How often a migrator that found another one at work asks for the migration lock again.
LOCK_POLL = 0.2

_CONCURRENT_INDEX = re.compile(
    r"CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+(\w+)", re.IGNORECASE)

_CREATE_TABLE = (
    "CREATE TABLE IF NOT EXISTS calmq_migrations ("
    " version integer PRIMARY KEY, name text NOT NULL,"
    " applied_at timestamptz NOT NULL DEFAULT now())"
)


@dataclass(frozen=True)
class Migration:
    """One numbered file: ``0007_workflows.sql`` is version 7, name ``workflows``."""

    version: int
    name: str

    @property
    def file(self) -> str:
        return f"{self.version:04d}_{self.name}.sql"


def statements(text: str) -> list[str]:
    """The statements of a no-transaction migration: comment lines dropped, split at each
    ``;`` that ends a line. Dollar quoting (a function body) is refused: its ``;`` would
    split it, and a function belongs in a transactional migration anyway."""
    if "$$" in text:
        raise ValueError("a no-transaction migration cannot hold dollar-quoted bodies")
    kept = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return [part.strip() for part in re.split(r";[ \t]*$", kept, flags=re.MULTILINE)
            if part.strip()]


def _drop_invalid_index(conn: psycopg.Connection[Any], statement: str) -> None:
    """Before ``CREATE INDEX CONCURRENTLY IF NOT EXISTS name``: an index of that name left
    invalid by a failed build would be kept by IF NOT EXISTS and never finished."""
    match = _CONCURRENT_INDEX.search(statement)
    if match is None:
        return
    row = conn.execute("SELECT NOT i.indisvalid FROM pg_index i JOIN pg_class c"
                       " ON c.oid = i.indexrelid WHERE c.relname = %s"
                       " AND c.relnamespace = current_schema()::regnamespace",
                       (match[1],)).fetchone()
    if row is not None and row[0]:
        conn.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{match[1]}"')


def _apply(conn: psycopg.Connection[Any], version: int, name: str, text: str) -> None:
    """Apply one migration and record it (see the module docstring for the two kinds)."""
    record = ("INSERT INTO calmq_migrations (version, name) VALUES (%s, %s)", (version, name))
    if text.startswith(NO_TRANSACTION):
        for statement in statements(text):
            _drop_invalid_index(conn, statement)
            conn.execute(statement.encode())
        conn.execute(*record)
        return
    for tries in range(1, LOCK_TRIES + 1):
        try:
            with conn.transaction():
                conn.execute(text.encode())
                conn.execute(*record)
            return
        except errors.LockNotAvailable:
            if tries == LOCK_TRIES:
                raise
            time.sleep(LOCK_PAUSE * tries)


def applied(conn: psycopg.Connection[Any]) -> set[int]:
    """The versions recorded as applied on ``conn``'s database (empty on a new one)."""
    # to_regclass, not the table itself: a dry run on an empty database must not fail (or
    # create the table) just because nothing was ever applied.
    if conn.execute("SELECT to_regclass('calmq_migrations')").fetchone() == (None,):
        return set()
    return {r[0] for r in conn.execute("SELECT version FROM calmq_migrations")}


def pending(database_url: str, *, connect_timeout: int | None = None) -> list[Migration]:
    """What ``migrate`` would apply now, in order; reads only, takes no lock."""
    with psycopg.connect(database_url, autocommit=True,
                         connect_timeout=connect_timeout) as conn:
        done = applied(conn)
    return [Migration(v, n) for v, n, _ in sql.migrations() if v not in done]


def unknown(database_url: str, *, connect_timeout: int | None = None) -> list[int]:
    """Versions the database records that this calmq does not ship: a newer release
    migrated it (this one is older, e.g. rolled back). Nothing to apply, but worth saying."""
    known = {v for v, _, _ in sql.migrations()}
    with psycopg.connect(database_url, autocommit=True,
                         connect_timeout=connect_timeout) as conn:
        return sorted(applied(conn) - known)


def apply_pending(database_url: str, *, connect_timeout: int | None = None,
                  on_wait: Callable[[], None] | None = None) -> list[Migration]:
    """Bring the database to the newest schema; returns the migrations applied by this call.

    ``on_wait`` is called once if another process holds the lock (so a person sees why the
    command pauses). A failing migration raises ``migration_failed`` naming its file; the
    ones before it stay applied, it and the ones after it are not.
    """
    applied_now: list[Migration] = []
    with psycopg.connect(database_url, autocommit=True,
                         connect_timeout=connect_timeout) as conn:
        # Session-level and waited for: a second migrator waits here until the first has
        # committed everything, then reads the table afresh and applies nothing twice. It
        # asks again and again rather than block in pg_advisory_lock: a statement blocked
        # there is a transaction in progress, and CREATE INDEX CONCURRENTLY (a no-transaction
        # migration of the first migrator) waits for every transaction in progress: the two
        # would wait for each other.
        got = conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_ID,)).fetchone()
        if got != (True,):
            if on_wait is not None:
                on_wait()
            while got != (True,):
                time.sleep(LOCK_POLL)
                got = conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_ID,)).fetchone()
        try:
            conn.execute(_CREATE_TABLE)
            done = applied(conn)
            for version, name, text in sql.migrations():
                if version in done:
                    continue
                migration = Migration(version, name)
                try:
                    _apply(conn, version, name, text)
                except psycopg.Error as exc:
                    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    undone = ("its statements before the failing one stay; the next run"
                              " repeats it" if text.startswith(NO_TRANSACTION)
                              else "was rolled back")
                    raise InfrastructureError(
                        f"migration {migration.file} failed and {undone} ({reason})",
                        code="migration_failed",
                    ) from exc
                applied_now.append(migration)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_ID,))
    return applied_now


def migrate(database_url: str) -> list[int]:
    """Bring the database to the newest schema; returns the versions applied now."""
    return [m.version for m in apply_pending(database_url)]
