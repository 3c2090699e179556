"""The console's input and artifact downloads against the running API (issue 42): a large
object is streamed, not read into the API's memory whole, and each download holds one of
its tenant's expensive reads (api_reads_per_tenant, 8 by default), so a ninth at once is
refused with 429 too_many_reads, as GET /v1/jobs/{id}/artifact is."""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

import psycopg
import pytest

from calmq.producers.console.session import COOKIE
from calmq.tooling.devstack import StackState
from tests.support.api import NoRedirect, console_session, create_tenant
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

SIZE = 64 * 1024 * 1024  # far more than the sockets' buffers: a stalled reader holds on
READS_PER_TENANT = 8  # the setting's default, which the stack's API runs with


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _big_job(stack: StackState, name: str) -> tuple[str, uuid.UUID]:
    """(key, job): a tenant's completed job whose input and artifact are one sparse object
    of SIZE bytes in the tenant's part of the stack's file store."""
    url = stack.env["CALMQ_DATABASE_URL"]
    key = create_tenant(url, name)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT id FROM tenants WHERE name = %s", (name,)).fetchone()
        assert row is not None
        tenant = row[0]
        job = uuid.uuid4()
        root = Path(unquote(urlparse(stack.env["CALMQ_OBJECT_STORE_URL"]).path))
        path = root / str(tenant) / "uploads" / f"{job}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            f.truncate(SIZE)  # sparse: made at once, read as zeros
        uri = path.as_uri()
        artifact = {"uri": uri, "sha256": "0" * 64, "content_type": "application/octet-stream",
                    "size": SIZE}
        conn.execute(
            "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool,"
            " step, attempt, max_attempts, input_ref, metadata, artifact)"
            " VALUES (%s, %s, 'summarize', 1, 'completed', 'bulk', 'default', 'summarize', 1,"
            " 3, %s, '{}', %s)", (job, tenant, uri, json.dumps(artifact)))
    return key, job


def _get(url: str, session: str) -> tuple[int, str, dict[str, str]]:
    """A GET with the session cookie, read whole: (status, body, headers)."""
    req = urllib.request.Request(url, headers={"Cookie": f"{COOKIE}={session}"})
    try:
        with urllib.request.build_opener(NoRedirect).open(req, timeout=30) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


@contextlib.contextmanager
def _stalled(base_url: str, path: str, session: str) -> Iterator[tuple[int, dict[str, str]]]:
    """A GET whose reader takes the status and headers and then reads nothing: the server
    is left with the rest to send. Yields (status, headers)."""
    address = urlparse(base_url)
    sock = socket.create_connection((address.hostname, address.port), timeout=60)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
                     f"Cookie: {COOKIE}={session}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            got = sock.recv(4096)
            assert got, f"the connection closed after {head!r}"
            head += got
        lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        yield int(lines[0].split()[1]), headers
    finally:
        sock.close()


@pytest.mark.parametrize("what", ["input", "artifact"])
def test_a_large_download_streams_and_takes_the_tenants_read_gate(
        stack: StackState, what: str) -> None:
    """Eight stalled downloads of a 64 MiB object each get their headers at once with its
    size, while the API's memory grows by less than half of one object; a ninth is refused
    with 429 too_many_reads, and once they close, a download goes through again."""
    base = stack.env["CALMQ_API_URL"]
    [api] = [p for p in stack.parts if p.name == "api"]
    assert api.pid is not None
    key, job = _big_job(stack, f"downloads-{what}-{uuid.uuid4().hex[:8]}")
    session = console_session(base, key)
    path = f"/console/jobs/{job}/{what}"
    before = _rss_bytes(api.pid)
    with contextlib.ExitStack() as held:
        for _ in range(READS_PER_TENANT):
            status, headers = held.enter_context(_stalled(base, path, session))
            assert status == 200
            assert headers["content-length"] == str(SIZE)
        assert _rss_bytes(api.pid) - before < SIZE // 2
        status, body, headers = _get(base + path, session)
        assert (status, headers.get("Retry-After")) == (429, "1")
        assert "too_many_reads" in body

    def again() -> bool:
        with _stalled(base, path, session) as (status, _headers):
            return status == 200

    wait_for(again, timeout=30, what="a download once the others closed")
