"""PgBouncer in transaction mode in front of the dev stack's PostgreSQL (Debian's package).

``calmq dev up --pgbouncer`` puts it between the services and the database as many platform
teams do: the API, workers, forwarder and the CLI connect through it
(``CALMQ_DATABASE_POOLER=transaction``: psycopg prepares no statements), while the relay
(logical replication) and the API's LISTEN session connect directly
(``CALMQ_RELAY_DATABASE_URL``, ``CALMQ_DIRECT_DATABASE_URL``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from calmq.errors import InfrastructureError
from calmq.tooling.devstack import processes

__all__ = ["PgBouncer", "pgbouncer_binary", "version"]

# Debian installs it outside a non-root user's PATH.
_PLACES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer")


def pgbouncer_binary() -> str:
    found = shutil.which("pgbouncer") or next((p for p in _PLACES if os.access(p, os.X_OK)),
                                              None)
    if found is None:
        raise InfrastructureError("PgBouncer is not installed: `make pgbouncer` (Debian's "
                                  "pgbouncer package) or apt-get install pgbouncer")
    return found


def version() -> str:
    import subprocess

    out = subprocess.run([pgbouncer_binary(), "--version"], capture_output=True, text=True,
                         check=False).stdout
    return out.splitlines()[0].removeprefix("PgBouncer ").strip() if out else "unknown"


@dataclass
class PgBouncer:
    home: Path
    port: int
    server_port: int  # PostgreSQL's
    pool_size: int = 40

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/calmq"

    def _config(self) -> str:
        return "\n".join([
            "[databases]",
            f"calmq = host=127.0.0.1 port={self.server_port} dbname=calmq",
            f"postgres = host=127.0.0.1 port={self.server_port} dbname=postgres",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "pool_mode = transaction",
            "auth_type = trust",
            f"auth_file = {self.home / 'users.txt'}",
            "admin_users = postgres",
            "max_client_conn = 2000",
            f"default_pool_size = {self.pool_size}",
            "ignore_startup_parameters = extra_float_digits,options",
            "log_connections = 0",
            "log_disconnections = 0",
            "",
        ])

    def start(self, user: str | None = None) -> int:
        """Write the configuration and start PgBouncer in the foreground of its own
        process group; returns its pid. It refuses to run as root: ``user`` runs it."""
        self.home.mkdir(parents=True, exist_ok=True)
        config = self.home / "pgbouncer.ini"
        config.write_text(self._config())
        (self.home / "users.txt").write_text('"postgres" ""\n')
        log = self.home / "pgbouncer.log"
        if user is not None:
            log.touch()
            for path in (self.home, config, self.home / "users.txt", log):
                shutil.chown(path, user, user)
        return processes.start([pgbouncer_binary(), str(config)], log, user=user)

    def ready(self) -> bool:
        return processes.port_open("127.0.0.1", self.port)
