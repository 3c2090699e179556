"""An unreachable part fails a command within seconds: one error line with its address.

Each command runs as a subprocess, as a person would run it, against a closed port; no
local stack is found (an empty data dir), so only the address given is tried.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _closed_port() -> int:
    """A port nothing listens on: bound, never listened on, so a connect is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _run(tmp_path: Path, env: dict[str, str], *argv: str) -> tuple[int, str, str, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    clean.update(env, CALMQ_DATA_DIR=str(tmp_path / "no-stack"))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "calmq.cli", *argv], env=clean,
                          capture_output=True, text=True, timeout=30, check=False)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


@pytest.mark.parametrize(("argv", "setting", "code"), [
    (["lag"], "CALMQ_KAFKA_BOOTSTRAP", "kafka_unreachable"),
    (["topics", "create"], "CALMQ_KAFKA_BOOTSTRAP", "kafka_unreachable"),
    (["schemas", "register"], "CALMQ_SCHEMA_REGISTRY_URL", "registry_unreachable"),
    # Database-only: it must not ask for CALMQ_KAFKA_BOOTSTRAP, which is not set here.
    (["relay", "--drop-slot"], "CALMQ_DATABASE_URL", "database_unreachable"),
    (["budget"], "CALMQ_DATABASE_URL", "database_unreachable"),
    (["tenants", "list"], "CALMQ_DATABASE_URL", "database_unreachable"),
    (["tenants", "create", "nobody"], "CALMQ_DATABASE_URL", "database_unreachable"),
    (["tenants", "add-key", "nobody"], "CALMQ_DATABASE_URL", "database_unreachable"),
])
def test_an_unreachable_part_is_one_error_line_with_its_address_within_seconds(
        tmp_path: Path, argv: list[str], setting: str, code: str) -> None:
    port = _closed_port()
    address = {"CALMQ_DATABASE_URL": f"postgresql://calmq@127.0.0.1:{port}/calmq",
               "CALMQ_SCHEMA_REGISTRY_URL": f"http://127.0.0.1:{port}"}.get(
                   setting, f"127.0.0.1:{port}")
    rc, _out, err, elapsed = _run(tmp_path, {setting: address}, *argv)
    assert rc == 1, err
    assert err.startswith(f"calmq: error [{code}]: "), err
    assert f"127.0.0.1:{port}" in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err  # no client library's retry warnings
    assert elapsed < 10


def test_an_unreachable_api_is_one_line_with_its_address_without_traceback(
        tmp_path: Path) -> None:
    """An API that does not answer: one `calmq: error [api_unreachable]` line naming it."""
    port = _closed_port()
    rc, _out, err, elapsed = _run(tmp_path, {"CALMQ_API_URL": f"http://127.0.0.1:{port}"},
                                  "status", "--api-key", "cq_x", "00000000-0000-0000-0000-0")
    assert rc == 1, err
    assert err.startswith("calmq: error [api_unreachable]: "), err
    assert f"127.0.0.1:{port}" in err
    assert "Traceback" not in err
    assert elapsed < 10


def test_health_names_each_part_that_is_down_and_exits_1(tmp_path: Path) -> None:
    """Every part set is probed at once: two down parts cost one timeout, not two."""
    port = _closed_port()
    rc, out, err, elapsed = _run(tmp_path, {
        "CALMQ_DATABASE_URL": f"postgresql://calmq@127.0.0.1:{port}/calmq",
        "CALMQ_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
    }, "health", "-o", "jsonl")
    import json

    rows = {r["part"]: r for r in map(json.loads, out.splitlines())}
    assert rc == 1, err
    assert rows["postgres"]["healthy"] is False
    assert rows["postgres"]["address"] == f"127.0.0.1:{port}/calmq"
    assert rows["kafka"]["healthy"] is False
    assert f"127.0.0.1:{port}" in rows["kafka"]["reason"]
    assert rows["api"]["healthy"] is None  # not set: reported, not counted as down
    assert "Traceback" not in err
    assert elapsed < 10
