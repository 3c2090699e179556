"""Child processes of the local stack: start detached, probe, stop by pid and group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from calmq.errors import InfrastructureError

__all__ = ["free_port", "is_alive", "port_open", "start", "stop", "wait_until"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) is not alive for our purposes.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def start(
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    user: str | None = None,
) -> int:
    """Start a detached child in its own session (so `down` can stop its whole group)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            user=user,
            start_new_session=True,
        )
    return proc.pid


def wait_until(
    check: Callable[[], bool], *, timeout: float, what: str, alive: Callable[[], bool] | None = None
) -> None:
    """Poll ``check`` until true; fail early when the process it waits for has died."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while time.monotonic() < deadline:
        if check():
            return
        if alive is not None and not alive():
            raise InfrastructureError(f"{what} exited before it was ready")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)
    raise InfrastructureError(f"{what} was not ready within {timeout:.0f} s")


def stop(pid: int, *, sig: int = signal.SIGTERM, timeout: float = 15.0) -> bool:
    """Stop a child and its process group: ``sig`` first, SIGKILL after ``timeout``."""
    if not is_alive(pid):
        return False
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return False
    own_group = pgid == pid  # we started it with start_new_session
    try:
        if own_group:
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not is_alive(pid):
            break
        time.sleep(0.05)
    else:
        try:
            if own_group:
                os.killpg(pgid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if own_group:
        # Leave nothing of the group behind (e.g. a postgres backend orphaned by a crash).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    _reap(pid)
    return True


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
