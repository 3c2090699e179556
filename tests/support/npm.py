"""The TypeScript client (clients/typescript) built for a test, as `make typescript` builds it.

``npm ci`` installs the devDependencies pinned by its package-lock.json from the npm
registry (only when the lock changed since the last install), then ``npm run build``
compiles the package, its tests and its examples. A file lock serialises the build across
test sessions that run at the same time in one checkout. Without node or npm the tests
that need them are skipped with the reason, and fail under CI=true.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["PACKAGE", "built_client", "installed_client", "node"]

PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "typescript"


def _missing(message: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def node() -> str:
    """The ``node`` executable; skips (CI: fails) without one."""
    found = shutil.which("node")
    if found is None:
        _missing("node is not installed: the TypeScript client's tests need Node.js 20+ and npm")
    assert found is not None
    return found


def _run(args: list[str], what: str) -> None:
    result = subprocess.run(args, cwd=PACKAGE, capture_output=True, text=True, timeout=600,
                            check=False)
    if result.returncode != 0:
        raise AssertionError(f"{what} failed ({result.returncode}):\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")


def _npm() -> str:
    node()
    npm = shutil.which("npm")
    if npm is None:
        _missing("npm is not installed: the TypeScript client's tests need it to build")
    assert npm is not None
    return npm


def _install(npm: str) -> None:
    installed = PACKAGE / "node_modules" / ".package-lock.json"
    lockfile = PACKAGE / "package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < lockfile.stat().st_mtime:
        _run([npm, "ci", "--no-audit", "--no-fund", "--prefer-offline"], "npm ci")


def installed_client() -> Path:
    """clients/typescript with its devDependencies (tsc, openapi-typescript) installed."""
    npm = _npm()
    with (PACKAGE / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _install(npm)
    return PACKAGE


def built_client() -> Path:
    """clients/typescript installed, and the client, its tests and examples compiled."""
    npm = _npm()
    with (PACKAGE / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _install(npm)
        _run([npm, "run", "build"], "npm run build")
    return PACKAGE
