"""Uploads stream to S3 without spooling: ten concurrent 100 MiB multipart submits through a
real `calmq api` process, against a real S3 HTTP endpoint (moto in server mode), stay within
the API pod's rendered limits — peak RSS under its memory limit, and peak bytes in its temp
folder (the pod's emptyDir at /tmp) under its ephemeral-storage limit.

The limits are read from the chart's values (deploy/helm/calmq/values.yaml: api.resources),
the figures are printed (docs/how-to/deploy-kubernetes.md quotes them) and, with
CALMQ_TEST_FIGURES set, written there as JSON. Each upload is 100 MiB, the API's largest;
the bound does not depend on it, as an upload holds one S3 part in memory whatever its
size.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from calmq.objects import PART_BYTES
from calmq.tooling.devstack import StackState, processes
from tests.support.upload_workflows import WORKFLOW
from tests.support.waiting import wait_for
from tests.support.workers import create_tenant_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CHART_VALUES = ROOT / "deploy" / "helm" / "calmq" / "values.yaml"
UPLOADS = 10
MIB = 100
BUCKET = "calmq-uploads"
LINE = b"a line of an uploaded text document, streamed to S3 in parts.\n"


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity) / (1 << 20)


def _peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert match, status
    return int(match.group(1)) / 1024


def _tree_bytes(folder: Path) -> int:
    total = 0
    for base, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += (Path(base) / name).stat().st_size
            except FileNotFoundError:
                continue  # removed while we looked
    return total


class DiskWatch:
    """The most bytes ever seen under a folder, sampled every 20 ms in a thread."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):  # poll
            self.peak = max(self.peak, _tree_bytes(self.folder))

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _tree_bytes(self.folder))


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 server as a process of its own (its 1 GiB of objects is not the API's)."""
    port = processes.free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    pid = processes.start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                           str(port)], log, cwd=ROOT)
    try:
        wait_for(lambda: processes.port_open("127.0.0.1", port), timeout=60,
                 what="moto's S3 server")
        yield f"http://127.0.0.1:{port}"
    finally:
        processes.stop(pid)


async def _body(size: int) -> AsyncIterator[bytes]:
    block = LINE * (256 * 1024 // len(LINE))
    sent = 0
    while sent < size:
        piece = block[: size - sent]
        sent += len(piece)
        yield piece


async def _upload(session: aiohttp.ClientSession, url: str, key: str, size: int
                  ) -> tuple[int, dict[str, object]]:
    with aiohttp.MultipartWriter("form-data") as form:
        # The workflow first: the API then holds the file to the workflow's own limit.
        form.append(WORKFLOW).set_content_disposition("form-data", name="workflow")
        part = form.append(_body(size), {"Content-Type": "text/plain"})
        part.set_content_disposition("form-data", name="file", filename="document.txt")
        async with session.post(f"{url}/v1/jobs", data=form,
                                headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json(content_type=None)


def test_ten_concurrent_100_mib_uploads_stay_within_the_api_pods_limits(
    stack: StackState, s3_endpoint: str, tmp_path: Path,
) -> None:
    """All ten are accepted and stored whole in S3, the API's peak RSS stays under the
    chart's memory limit for it, and nothing the size of an upload lands on its disk."""
    import boto3

    aws = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="test",
                      aws_secret_access_key="test", region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    resources = yaml.safe_load(CHART_VALUES.read_text())["api"]["resources"]["limits"]
    memory_limit, disk_limit = (_mebibytes(resources["memory"]),
                                _mebibytes(resources["ephemeral-storage"]))
    scratch = tmp_path / "api-tmp"  # the pod's /tmp
    scratch.mkdir()
    port = processes.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CALMQ_", "AWS_"))}
    env.update(stack.env)
    env.update(aws)
    env.update({"CALMQ_OBJECT_STORE_URL": f"s3://{BUCKET}/objects", "TMPDIR": str(scratch),
                "CALMQ_API_HOST": "127.0.0.1", "CALMQ_API_PORT": str(port),
                "CALMQ_WORKFLOW_MODULES": "tests.support.upload_workflows",
                "PYTHONUNBUFFERED": "1"})
    _tenant, key = create_tenant_id(stack.env["CALMQ_DATABASE_URL"],
                                    f"uploads-{uuid.uuid4().hex[:8]}")
    log = tmp_path / "api.log"
    pid = processes.start([sys.executable, "-m", "calmq.cli", "api"], log, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    size = MIB * 1024 * 1024
    try:
        wait_for(lambda: not processes.is_alive(pid) or processes.port_open("127.0.0.1", port),
                 timeout=60, what="the API")
        assert processes.is_alive(pid), log.read_text()
        idle = _peak_rss_mib(pid)

        async def run() -> list[tuple[int, dict[str, object]]]:
            timeout = aiohttp.ClientTimeout(total=480)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                return await asyncio.gather(*(_upload(session, url, key, size)
                                              for _ in range(UPLOADS)))

        started = time.monotonic()
        with DiskWatch(scratch) as disk:
            answers = asyncio.run(run())
        seconds = time.monotonic() - started
        peak = _peak_rss_mib(pid)
    finally:
        processes.stop(pid)
    assert [status for status, _ in answers] == [202] * UPLOADS, answers
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="objects/")["Contents"]
    assert sorted(o["Size"] for o in listed) == [size] * UPLOADS
    assert s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
    figures = {"uploads": UPLOADS, "mib_each": MIB, "seconds": round(seconds, 1),
               "api_rss_idle_mib": round(idle, 1), "api_peak_rss_mib": round(peak, 1),
               "memory_limit_mib": memory_limit,
               "peak_tmp_bytes": disk.peak, "ephemeral_storage_limit_mib": disk_limit,
               "part_mib": PART_BYTES / (1 << 20)}
    print(json.dumps(figures))
    if os.environ.get("CALMQ_TEST_FIGURES"):
        Path(os.environ["CALMQ_TEST_FIGURES"]).write_text(json.dumps(figures, indent=1))
    assert peak < memory_limit, figures
    assert disk.peak < disk_limit * (1 << 20), figures
    # Not spooled: no more on disk than one part, whatever the uploads' size.
    assert disk.peak < PART_BYTES, figures
