"""The shell steps of docker-compose.kafka.yml run against the same software the local stack
and the test suite run: the registry's healthcheck against Apicurio at the stack's version,
the S3 healthcheck and the bucket step against moto's server. There is no Docker engine here,
so each command runs as a local process with the container's host and port replaced."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
import yaml

from calmq.tooling.devstack import StackState, processes

pytestmark = pytest.mark.integration
moto_server = pytest.importorskip("moto.server")

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.kafka.yml"


def _services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE.read_text())["services"]
    return found


def _healthcheck(service: str, old: str, new: str) -> list[str]:
    """The service's healthcheck argv (without CMD), its address ``old`` replaced by ``new``."""
    test = _services()[service]["healthcheck"]["test"]
    assert test[0] == "CMD", test
    assert any(old in word for word in test[1:]), f"{service}'s healthcheck has no {old}"
    return [word.replace(old, new) for word in test[1:]]


@pytest.fixture(scope="module")
def moto() -> Iterator[str]:
    port = processes.free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop()


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # `python` in the image is the interpreter that has calmq; here it is this one.
    argv = [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False,
                          env=env)


def test_the_registry_healthcheck_passes_against_apicurio(stack: StackState) -> None:
    """The bash /dev/tcp check of the schema-registry service succeeds against Apicurio at the
    stack's version (the image's version), and fails where nothing listens."""
    url = urlsplit(next(p.address for p in stack.parts if p.name == "schema-registry"))
    assert url.hostname is not None
    live = _healthcheck("schema-registry", "/dev/tcp/127.0.0.1/8080",
                        f"/dev/tcp/{url.hostname}/{url.port}")
    done = _run(live)
    assert done.returncode == 0, done.stderr
    dead = _healthcheck("schema-registry", "/dev/tcp/127.0.0.1/8080",
                        f"/dev/tcp/127.0.0.1/{processes.free_port()}")
    assert _run(dead).returncode != 0


def test_the_s3_healthcheck_and_the_bucket_step_work_against_moto(moto: str) -> None:
    """The s3 service's healthcheck passes against moto's server, and init's bucket step
    makes the bucket calmq's object store URL names, twice over (init runs again after a
    restart, and moto forgets its buckets on one)."""
    done = _run(_healthcheck("s3", "localhost:5000", moto))
    assert done.returncode == 0, done.stderr
    [bucket_step] = [shlex.split(part) for part in _services()["init"]["command"][-1].split("&&")
                     if "create_bucket" in part]
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://{moto}", "AWS_ACCESS_KEY_ID": "calmq",
           "AWS_SECRET_ACCESS_KEY": "calmq-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    for attempt in (1, 2):
        done = _run(bucket_step, env)
        assert done.returncode == 0, f"run {attempt}: {done.stderr}"
    client = boto3.client("s3", endpoint_url=f"http://{moto}", region_name="us-east-1",
                          aws_access_key_id="calmq", aws_secret_access_key="calmq-secret")
    buckets = [b["Name"] for b in client.list_buckets()["Buckets"]]
    store_url = _services()["api"]["environment"]["CALMQ_OBJECT_STORE_URL"]
    assert urlsplit(store_url).netloc in buckets
