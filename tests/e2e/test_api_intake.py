"""Submitting over the API: streamed uploads, input references, idempotency, keys, tenancy."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.intake import ApiProcess, db, running_api
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

BOUNDARY = "calmqtestboundary"


def multipart(fields: dict[str, str], file: bytes | None = None, *,
              boundary: str = BOUNDARY) -> bytes:
    out = b""
    for name, value in fields.items():
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n"
                f"{value}\r\n").encode()
    if file is not None:
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"in.txt\"\r\nContent-Type: text/plain\r\n\r\n").encode()
        out += file + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


MP_HEADERS = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


@pytest.fixture(scope="module")
def small_api(stack: StackState) -> ApiProcess:
    """An API with a 64 KiB upload limit and a 5-minute auth cache."""
    with running_api(stack, {"CALMQ_MAX_UPLOAD_BYTES": str(64 * 1024),
                             "CALMQ_AUTH_CACHE_SECONDS": "300"}) as api:
        yield api


def _tenant(stack: StackState, url: str | None = None) -> tuple[Api, str, uuid.UUID]:
    name = f"intake-{uuid.uuid4().hex[:8]}"
    key = create_tenant(stack.env["CALMQ_DATABASE_URL"], name)
    with db(stack) as conn:
        row = conn.execute("SELECT id FROM tenants WHERE name = %s", (name,)).fetchone()
    assert row is not None
    return Api(url or stack.env["CALMQ_API_URL"], key), name, row[0]


def _objects(stack: StackState, tenant_id: uuid.UUID) -> list[Path]:
    root = Path(urlparse(stack.env["CALMQ_OBJECT_STORE_URL"]).path) / str(tenant_id)
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_multipart_file_is_stored_and_referenced(stack: StackState) -> None:
    """A multipart submit stores the file under the tenant's prefix and the job points at it."""
    api, _name, tenant_id = _tenant(stack)
    content = b"a long document " * 5000
    status, _h, body = api.call("POST", "/v1/jobs", raw=multipart(
        {"workflow": "summarize", "priority": "bulk", "metadata": '{"k": 1}'}, content),
        headers=MP_HEADERS)
    assert status == 202, body
    with db(stack) as conn:
        row = conn.execute("SELECT input_ref, input, metadata FROM jobs WHERE id = %s",
                           (body["job_id"],)).fetchone()
    assert row is not None
    ref, inp, meta = row
    assert inp is None
    assert meta == {"k": 1}
    assert f"/{tenant_id}/inputs/" in ref
    assert Path(urlparse(ref).path).read_bytes() == content


def test_oversized_file_is_413_and_nothing_is_stored(
        stack: StackState, small_api: ApiProcess) -> None:
    """A file over max_upload_bytes answers 413 file_too_large; no object, no job remain."""
    api, _name, tenant_id = _tenant(stack, small_api.url)
    status, headers, body = api.call("POST", "/v1/jobs", raw=multipart(
        {"workflow": "summarize"}, b"x" * (64 * 1024 + 1)), headers=MP_HEADERS)
    assert status == 413, body
    assert headers["Content-Type"].startswith("application/problem+json")
    assert body["code"] == "file_too_large"
    assert _objects(stack, tenant_id) == []
    object_root = Path(urlparse(stack.env["CALMQ_OBJECT_STORE_URL"]).path)
    assert not list(object_root.rglob("*.up"))  # no temp file left either
    with db(stack) as conn:
        assert conn.execute("SELECT count(*) FROM jobs WHERE tenant_id = %s",
                            (tenant_id,)).fetchone() == (0,)


@pytest.mark.parametrize(("raw", "headers", "code"), [
    pytest.param(b"--calmqtestboundary\r\nContent-Disposition: form-data; name=\"workflow\"\r\n"
                 b"\r\nsumma", MP_HEADERS, "invalid_multipart", id="truncated"),
    pytest.param(multipart({"workflow": "summarize"}, b"abc"),
                 {"Content-Type": "multipart/form-data"}, "invalid_multipart", id="no-boundary"),
    pytest.param(b'--calmqtestboundary\r\nContent-Disposition: form-data; name="\x02x"\r\n\r\n'
                 b"v\r\n--calmqtestboundary--\r\n", MP_HEADERS, "invalid_multipart",
                 id="control-char-in-part-header"),
    pytest.param(multipart({"workflow": "summarize"}), MP_HEADERS, "missing_file",
                 id="no-file-part"),
    pytest.param(multipart({"workflow": "summarize", "metadata": "{nope"}, b"abc"), MP_HEADERS,
                 "invalid_json", id="metadata-not-json"),
    pytest.param(multipart({"workflow": "summarize", "metadata": '{"n": 1e999}'}, b"abc"),
                 MP_HEADERS, "non_finite_number", id="metadata-1e999"),
    pytest.param(multipart({"workflow": "summarize", "metadata": '{"n": NaN}'}, b"abc"),
                 MP_HEADERS, "invalid_json", id="metadata-nan"),
    pytest.param(multipart({"workflow": "summarize", "input": "{}"}, b"abc"), MP_HEADERS,
                 "invalid_body", id="input-and-file"),
    pytest.param(multipart({"workflow": "nope"}, b"abc"), MP_HEADERS, "unknown_workflow",
                 id="unknown-workflow"),
])
def test_malformed_multipart_is_problem_and_stores_nothing(
        stack: StackState, raw: bytes, headers: dict[str, str], code: str) -> None:
    """Each malformed multipart answers a 4xx problem with its code; no object or job remains."""
    api, _name, tenant_id = _tenant(stack)
    status, hdrs, body = api.call("POST", "/v1/jobs", raw=raw, headers=headers)
    assert 400 <= status < 500, body
    assert hdrs["Content-Type"].startswith("application/problem+json")
    assert body["code"] == code
    assert _objects(stack, tenant_id) == []
    with db(stack) as conn:
        assert conn.execute("SELECT count(*) FROM jobs WHERE tenant_id = %s",
                            (tenant_id,)).fetchone() == (0,)


def test_input_ref_outside_tenant_prefix_is_403(stack: StackState) -> None:
    """input_ref into another tenant, through .., another bucket or scheme answers 403."""
    api, _name, tenant_id = _tenant(stack)
    base = stack.env["CALMQ_OBJECT_STORE_URL"].rstrip("/")
    other = uuid.uuid4()
    for ref in (f"{base}/{other}/inputs/x", f"{base}/{tenant_id}/../{other}/x",
                f"{base}/{tenant_id}/%2e%2e/{other}/x", f"{base}/{tenant_id}",
                f"{base}/{tenant_id}x/inputs/y", f"s3://bucket/{tenant_id}/x",
                f"file:///etc/{tenant_id}/passwd"):
        status, hdrs, body = api.call("POST", "/v1/jobs",
                                      {"workflow": "summarize", "input_ref": ref})
        assert status == 403, (ref, body)
        assert hdrs["Content-Type"].startswith("application/problem+json")
        assert body["code"] == "input_ref_forbidden"
    # Inside its own prefix, an object that exists (issue 15: a referenced input must exist,
    # and is checked against the workflow's rules) is accepted.
    mine = Path(urlparse(base).path) / str(tenant_id) / "inputs" / "mine.txt"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text("my own document")
    status, _h, body = api.call("POST", "/v1/jobs", {
        "workflow": "summarize", "input_ref": f"{base}/{tenant_id}/inputs/mine.txt"})
    assert status == 202, body


def test_idempotency_key_same_body_same_job_other_body_409(stack: StackState) -> None:
    """The same key and body answers the same job; the same key with another body is 409."""
    api, _name, _tid = _tenant(stack)
    body = {"workflow": "summarize", "input": {"text": "once"}}
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    s1, _h, b1 = api.call("POST", "/v1/jobs", body, headers=key)
    s2, _h, b2 = api.call("POST", "/v1/jobs", body, headers=key)
    assert (s1, s2) == (202, 202)
    assert b1["job_id"] == b2["job_id"]
    s3, _h, b3 = api.call("POST", "/v1/jobs", {**body, "priority": "interactive"}, headers=key)
    assert s3 == 409
    assert b3["code"] == "idempotency_key_reused"


def test_revoked_key_is_401_at_once_despite_the_auth_cache(
        stack: StackState, small_api: ApiProcess) -> None:
    """`calmq tenants revoke-key` makes the key answer 401 although the cache holds it 5 min."""
    api, name, _tid = _tenant(stack, small_api.url)
    assert api.call("GET", f"/v1/jobs/{uuid.uuid4()}")[0] == 404  # key cached as valid
    out = subprocess.run(
        [sys.executable, "-m", "calmq.cli", "tenants", "revoke-key", name,
         "--key-prefix", api.key[:12]],
        env={**stack.env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60,
        check=False)
    assert out.returncode == 0, out.stderr
    status = wait_for(lambda: (s := api.call("GET", f"/v1/jobs/{uuid.uuid4()}")[0]) == 401 and s,
                      timeout=10, what="the revoked key to be refused")
    assert status == 401
    _s, hdrs, body = api.call("POST", "/v1/jobs", {"workflow": "summarize", "input": {"text": "x"}})
    assert body["code"] == "invalid_api_key"
    assert hdrs["Content-Type"].startswith("application/problem+json")


def test_added_key_works_and_tenants_cli_prints_key_last(stack: StackState) -> None:
    """`calmq tenants add-key` prints a new working key alone on its last line."""
    _api, name, _tid = _tenant(stack)
    out = subprocess.run([sys.executable, "-m", "calmq.cli", "tenants", "add-key", name],
                         env={**stack.env, "PATH": "/usr/bin:/bin"}, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip().splitlines()[-1]
    assert key.startswith("cq_")
    assert Api(stack.env["CALMQ_API_URL"], key).call("GET", "/v1/jobs")[0] == 200


def test_unknown_and_other_tenants_jobs_are_404(stack: StackState) -> None:
    """An unknown id, a malformed id and another tenant's job all answer 404 problems."""
    mine, _n, _t = _tenant(stack)
    theirs, _n2, _t2 = _tenant(stack)
    job_id = theirs.submit({"text": "private", "mode": "success"})
    for path in (f"/v1/jobs/{uuid.uuid4()}", "/v1/jobs/not-a-uuid", f"/v1/jobs/{job_id}",
                 f"/v1/jobs/{job_id}/events", f"/v1/jobs/{job_id}/artifact"):
        status, hdrs, body = mine.call("GET", path)
        assert status == 404, (path, body)
        assert hdrs["Content-Type"].startswith("application/problem+json")
    for method, path in (("POST", f"/v1/jobs/{job_id}/cancel"), ("DELETE", f"/v1/jobs/{job_id}")):
        status, _h, body = mine.call(method, path)
        assert status == 404, (path, body)
    listed = mine.call("GET", "/v1/jobs")[2]
    assert listed["jobs"] == []
    assert theirs.job(job_id)["job_id"] == job_id


def _many_parts(count: int) -> bytes:
    """The file first (so it is already stored when the cap is hit), then ``count`` fields."""
    out = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
           f"filename=\"in.txt\"\r\nContent-Type: text/plain\r\n\r\n").encode() + b"abc\r\n"
    out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"workflow\"\r\n\r\n"
            f"summarize\r\n").encode()
    for i in range(count):
        out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"f{i}\"\r\n\r\n"
                f"v\r\n").encode()
    return out + f"--{BOUNDARY}--\r\n".encode()


def _big_fields(count: int, size: int) -> bytes:
    out = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
           f"filename=\"in.txt\"\r\nContent-Type: text/plain\r\n\r\n").encode() + b"abc\r\n"
    for i in range(count):
        out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"f{i}\"\r\n\r\n"
                ).encode() + b"y" * size + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


@pytest.mark.parametrize(("raw", "code"), [
    pytest.param(_many_parts(5000), "too_many_parts", id="5000-parts"),
    # Each field under the 1 MiB per-field limit, 8 MiB in all: over the default total.
    pytest.param(_big_fields(8, 1024 * 1024 - 16), "fields_too_large", id="8-MiB-of-fields"),
])
def test_multipart_caps_parts_and_field_bytes_and_stores_nothing(
        stack: StackState, raw: bytes, code: str) -> None:
    """The session API (default caps) refuses a form with too many parts or too many field
    bytes with a 413 problem; the file stored before the cap was hit is deleted, no job."""
    api, _name, tenant_id = _tenant(stack)
    status, hdrs, body = api.call("POST", "/v1/jobs", raw=raw, headers=MP_HEADERS)
    assert status == 413, body
    assert hdrs["Content-Type"].startswith("application/problem+json")
    assert body["code"] == code
    assert _objects(stack, tenant_id) == []
    with db(stack) as conn:
        assert conn.execute("SELECT count(*) FROM jobs WHERE tenant_id = %s",
                            (tenant_id,)).fetchone() == (0,)


def test_multipart_caps_are_settings(stack: StackState) -> None:
    """With CALMQ_MAX_MULTIPART_PARTS=3 a 4-part form is refused and a 3-part one accepted."""
    with running_api(stack, {"CALMQ_MAX_MULTIPART_PARTS": "3",
                             "CALMQ_MAX_MULTIPART_FIELD_BYTES": "2048"}) as small:
        api, _name, tenant_id = _tenant(stack, small.url)
        status, _h, body = api.call("POST", "/v1/jobs", raw=multipart(
            {"workflow": "summarize", "priority": "bulk", "metadata": "{}"}, b"abc"),
            headers=MP_HEADERS)
        assert (status, body["code"]) == (413, "too_many_parts")
        status, _h, body = api.call("POST", "/v1/jobs", raw=multipart(
            {"workflow": "summarize", "metadata": '{"k": "' + "z" * 3000 + '"}'}, b"abc"),
            headers=MP_HEADERS)
        assert (status, body["code"]) == (413, "fields_too_large")
        assert _objects(stack, tenant_id) == []
        status, _h, body = api.call("POST", "/v1/jobs", raw=multipart(
            {"workflow": "summarize", "priority": "bulk"}, b"abc"), headers=MP_HEADERS)
        assert status == 202, body


def test_prefer_wait_answers_202_when_the_wait_fails_after_the_commit(stack: StackState,
                                                                   tmp_path: Path) -> None:
    """An API whose object store is not the workers' cannot read the finished job's result:
    a submit with Prefer: wait still answers 202 with the committed job's id, not an error,
    and the job completes."""
    store = tmp_path / "another-store"
    store.mkdir()
    with running_api(stack, {"CALMQ_OBJECT_STORE_URL": store.as_uri()}) as other:
        api, _name, _tenant_id = _tenant(stack, other.url)
        status, _h, body = api.call(
            "POST", "/v1/jobs", {"workflow": "summarize", "input": {"text": "wait for me"}},
            headers={"Prefer": "wait=30"})
        assert status == 202, body
        assert body["status"] == "queued"
        assert body["status_url"] == f"/v1/jobs/{body['job_id']}"
        shared = Api(stack.env["CALMQ_API_URL"], api.key)
        wait_for(lambda: shared.job(body["job_id"])["status"] == "completed", timeout=60,
                 what="the job to complete")
