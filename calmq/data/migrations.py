"""Apply the numbered migrations in calmq/sql/migrations, each once, in order.

Every writer takes one PostgreSQL advisory lock first, so that any number of processes
migrating at once (two `calmq migrate` Jobs, a Job and `calmq dev up`) apply each migration
exactly once: the second waits, then finds nothing left to do. A migration and its row in
``calmq_migrations`` commit in one transaction, so a crash leaves it either applied and
recorded or neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from calmq import sql
from calmq.errors import InfrastructureError

__all__ = ["LOCK_ID", "Migration", "applied", "apply_pending", "migrate", "pending", "unknown"]

# The advisory lock's key ("calmq" in ASCII): one name for every process that migrates.
LOCK_ID = 0x63616C6D71

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
        # Session-level and waited for: a second migrator blocks here until the first has
        # committed everything, then reads the table afresh and applies nothing twice.
        got = conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_ID,)).fetchone()
        if got != (True,):
            if on_wait is not None:
                on_wait()
            conn.execute("SELECT pg_advisory_lock(%s)", (LOCK_ID,))
        try:
            conn.execute(_CREATE_TABLE)
            done = applied(conn)
            for version, name, text in sql.migrations():
                if version in done:
                    continue
                migration = Migration(version, name)
                try:
                    with conn.transaction():
                        conn.execute(text.encode())
                        conn.execute(
                            "INSERT INTO calmq_migrations (version, name) VALUES (%s, %s)",
                            (version, name),
                        )
                except psycopg.Error as exc:
                    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    raise InfrastructureError(
                        f"migration {migration.file} failed and was rolled back ({reason})",
                        code="migration_failed",
                    ) from exc
                applied_now.append(migration)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_ID,))
    return applied_now


def migrate(database_url: str) -> list[int]:
    """Bring the database to the newest schema; returns the versions applied now."""
    return [m.version for m in apply_pending(database_url)]
