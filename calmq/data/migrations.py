"""Apply the numbered migrations in calmq/sql/migrations, each once, in order."""

from __future__ import annotations

import psycopg

from calmq import sql

__all__ = ["migrate"]

# An advisory lock so that several processes starting at once migrate one at a time.
_LOCK_ID = 0x63616C6D71


def migrate(database_url: str) -> list[int]:
    """Bring the database to the newest schema; returns the versions applied now."""
    applied_now: list[int] = []
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_ID,))
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS calmq_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {r[0] for r in conn.execute("SELECT version FROM calmq_migrations")}
            for version, name, text in sql.migrations():
                if version in done:
                    continue
                with conn.transaction():
                    conn.execute(text.encode())
                    conn.execute(
                        "INSERT INTO calmq_migrations (version, name) VALUES (%s, %s)",
                        (version, name),
                    )
                applied_now.append(version)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_ID,))
    return applied_now
