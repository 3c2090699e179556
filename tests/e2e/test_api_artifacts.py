"""Artifacts a consumer can fetch: a presigned HTTPS URL for S3, the API's route for files.

The S3 case runs an API process of its own against a real S3 HTTP endpoint (moto in server
mode); the file case uses the session stack's API and a job its worker completed.
"""

from __future__ import annotations

import hashlib
import json
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

import psycopg
import pytest
from psycopg.types.json import Jsonb

from calmq.producers.client import enqueue
from calmq.tooling.devstack import StackState, processes
from tests.support.api import Api, create_tenant
from tests.support.intake import ApiProcess, running_api
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

_BUCKET = "calmq-artifacts"
_AWS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = processes.free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, **_client_args()).create_bucket(Bucket=_BUCKET)
    try:
        yield endpoint
    finally:
        server.stop()


def _client_args() -> dict[str, str]:
    return {"aws_access_key_id": "test", "aws_secret_access_key": "test",
            "region_name": "us-east-1"}


@pytest.fixture(scope="module")
def s3_api(stack: StackState, s3_endpoint: str) -> Iterator[ApiProcess]:
    settings = {"CALMQ_OBJECT_STORE_URL": f"s3://{_BUCKET}/objects",
                "CALMQ_ARTIFACT_LINK_SECONDS": "120", "AWS_ENDPOINT_URL": s3_endpoint, **_AWS}
    with running_api(stack, settings) as api:
        yield api


def _completed_on_s3(stack: StackState, s3_endpoint: str, tenant: str, body: bytes) -> str:
    """A job of ``tenant`` completed with an artifact in the bucket (what a worker with an
    S3 object store leaves behind); its id."""
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        tenant_id = conn.execute("SELECT id FROM tenants WHERE name = %s",
                                 (tenant,)).fetchone()[0]
        job_id = enqueue(conn, tenant_id=tenant_id, workflow="summarize",
                         input={"text": "stored on s3", "mode": "success"})
        key = f"objects/{tenant_id}/artifacts/{job_id}/summarize.json"
        boto3.client("s3", endpoint_url=s3_endpoint, **_client_args()).put_object(
            Bucket=_BUCKET, Key=key, Body=body, ContentType="application/json")
        artifact = {"uri": f"s3://{_BUCKET}/{key}", "sha256": hashlib.sha256(body).hexdigest(),
                    "content_type": "application/json", "size": len(body)}
        # The job.requested the relay publishes for it finds the job finished: the worker's
        # claim skips it, as it skips any redelivered message of a finished job.
        conn.execute("UPDATE jobs SET status = 'completed', artifact = %s WHERE id = %s",
                     (Jsonb(artifact), job_id))
    return str(job_id)


def _fetch(url: str, headers: dict[str, str] | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                timeout=10) as resp:
        return bytes(resp.read())


def test_s3_artifact_has_a_presigned_url_that_needs_no_calmq_key(
    stack: StackState, s3_endpoint: str, s3_api: ApiProcess
) -> None:
    """GET /v1/jobs/{id} names an https-style presigned URL, valid for the setting's lifetime,
    that fetches the artifact's exact bytes without the tenant's key; another tenant sees no
    such job."""
    tenant = f"s3-{uuid.uuid4().hex[:8]}"
    api = Api(s3_api.url, create_tenant(stack.env["CALMQ_DATABASE_URL"], tenant))
    body = json.dumps({"summary": "fetched straight from the bucket"}).encode()
    job_id = _completed_on_s3(stack, s3_endpoint, tenant, body)
    artifact = api.job(job_id)["artifact"]
    link = urlparse(artifact["download_url"])
    assert f"{link.scheme}://{link.netloc}" == s3_endpoint
    assert parse_qs(link.query)["X-Amz-Expires"] == ["120"]
    assert artifact["download_expires_at"] is not None
    fetched = _fetch(artifact["download_url"])  # no Authorization header
    assert hashlib.sha256(fetched).hexdigest() == artifact["sha256"]
    assert fetched == body
    other = Api(s3_api.url, create_tenant(stack.env["CALMQ_DATABASE_URL"],
                                          f"s3-other-{uuid.uuid4().hex[:8]}"))
    status, _h, problem = other.call("GET", f"/v1/jobs/{job_id}")
    assert (status, problem["code"]) == (404, "not_found")


def test_file_artifact_points_at_the_api_route(stack: StackState) -> None:
    """A file:// artifact (the local stack's store) is fetched through the API's own route,
    with the tenant's key; the bytes match the recorded digest."""
    key = create_tenant(stack.env["CALMQ_DATABASE_URL"], f"file-{uuid.uuid4().hex[:8]}")
    api = Api(stack.env["CALMQ_API_URL"], key)
    job_id = api.submit({"text": "a file artifact", "mode": "success"})
    job: dict[str, Any] = wait_for(
        lambda: (j := api.job(job_id))["status"] == "completed" and j, timeout=60,
        what="the job to complete")
    artifact = job["artifact"]
    assert artifact["download_url"] == f"/v1/jobs/{job_id}/artifact"
    assert artifact["download_expires_at"] is None
    fetched = _fetch(stack.env["CALMQ_API_URL"] + artifact["download_url"],
                     {"Authorization": f"Bearer {key}"})
    assert hashlib.sha256(fetched).hexdigest() == artifact["sha256"]
