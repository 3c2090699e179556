"""An extra API process against the session stack, with its own settings (for the API tests).

The session stack's API runs with the defaults; tests that need another setting (a small
upload limit, private callback targets allowed, a long auth cache) or that kill the API
start one of these instead, so they never disturb the shared one.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

from calmq.tooling.devstack import StackState, processes


@dataclass
class ApiProcess:
    pid: int
    url: str
    log: Path

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=1) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        processes.stop(self.pid, sig=signal.SIGKILL, timeout=5)


def start_api(stack: StackState, settings: Mapping[str, str] | None = None, *,
              port: int | None = None) -> ApiProcess:
    """An API process on ``port`` (a free one by default; the same one to restart it)."""
    port = port or processes.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    env.update(stack.env)
    env.update(settings or {})
    env["CALMQ_API_PORT"] = str(port)
    env["PYTHONUNBUFFERED"] = "1"
    log = Path(tempfile.mkdtemp(prefix="calmq-api-")) / "api.log"
    pid = processes.start([sys.executable, "-m", "calmq.cli", "api"], log, env=env)
    api = ApiProcess(pid, f"http://127.0.0.1:{port}", log)
    try:
        processes.wait_until(api.healthy, timeout=30, what="extra API",
                             alive=lambda: processes.is_alive(pid))
    except BaseException:
        processes.stop(pid)
        raise
    return api


@contextmanager
def running_api(stack: StackState, settings: Mapping[str, str] | None = None
                ) -> Iterator[ApiProcess]:
    api = start_api(stack, settings)
    try:
        yield api
    finally:
        processes.stop(api.pid)


def db(stack: StackState) -> psycopg.Connection:
    return psycopg.connect(stack.env["CALMQ_DATABASE_URL"], autocommit=True)
