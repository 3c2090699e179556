"""Notifications: SSE woken by LISTEN/NOTIFY, and signed, retried, recorded webhooks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from calmq.data import tenants
from calmq.data.migrations import migrate
from calmq.producers.client import Client, enqueue
from calmq.producers.webhooks import standard_secret, verify
from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant, lifecycle
from tests.support.cli import calmq, calmq_env
from tests.support.intake import ApiProcess, db, running_api
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e


class Receiver:
    """A real HTTP server that records callbacks and fails the first ``fail_first`` of them."""

    def __init__(self, fail_first: int = 0) -> None:
        self.calls: list[tuple[dict[str, str], bytes]] = []
        self.fail_first = fail_first
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls.append((dict(self.headers), body))
                self.send_response(500 if len(outer.calls) <= outer.fail_first else 204)
                self.end_headers()

            def log_message(self, *_a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def _webhook_api(stack: StackState, **settings: str) -> Iterator[tuple[ApiProcess, str]]:
    """An API that may call back to 127.0.0.1, retrying quickly, on a database of its own.

    Its own database, because every API process dispatches webhooks: the session API
    (private targets refused, the default) would otherwise claim these deliveries too.
    Without a worker there, the test ends its job by cancelling it (a terminal event).
    """
    name = f"calmq_webhooks_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = stack.env["CALMQ_DATABASE_URL"].rsplit("/", 1)[0] + "/" + name
    migrate(url)
    with running_api(stack, {"CALMQ_DATABASE_URL": url, "CALMQ_WEBHOOK_ALLOW_PRIVATE": "true",
                             "CALMQ_WEBHOOK_BACKOFF_SECONDS": "0.2", **settings}) as api:
        yield api, url


@pytest.fixture(scope="module")
def local_api(stack: StackState) -> Iterator[tuple[ApiProcess, str]]:
    """A webhook API with the default settings (payload version 2)."""
    with _webhook_api(stack) as found:
        yield found


def _tenant(stack: StackState, url: str) -> tuple[Api, str]:
    name = f"notify-{uuid.uuid4().hex[:8]}"
    return Api(url, create_tenant(stack.env["CALMQ_DATABASE_URL"], name)), name


def test_sse_stream_sees_queued_running_completed_in_order(stack: StackState) -> None:
    """An SSE stream opened right after submit sees queued, running, completed, then ends."""
    api, _name = _tenant(stack, stack.env["CALMQ_API_URL"])

    async def watch() -> list[dict[str, Any]]:
        async with Client(api.base_url, api.key) as client:
            accepted = await client.submit("summarize", {"text": "stream me", "mode": "success",
                                                         "delay_ms": 400})
            return [e async for e in client.events(accepted["job_id"])]

    seen = asyncio.run(asyncio.wait_for(watch(), timeout=60))
    assert lifecycle(seen) == ["queued", "running", "completed"]
    assert [int(e["id"]) for e in seen] == sorted(int(e["id"]) for e in seen)


def test_sse_resumes_after_last_event_id(stack: StackState) -> None:
    """Reconnecting with Last-Event-ID replays only the events after it."""
    api, _name = _tenant(stack, stack.env["CALMQ_API_URL"])
    job_id = api.submit({"text": "resume", "mode": "success"})
    wait_for(lambda: api.job(job_id)["status"] == "completed", timeout=60, what="completion")

    async def replay() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with Client(api.base_url, api.key) as client:
            every = [e async for e in client.events(job_id)]
            rest = [e async for e in client.events(job_id, after=int(every[0]["id"]))]
            return every, rest

    every, rest = asyncio.run(asyncio.wait_for(replay(), timeout=30))
    assert [e["type"] for e in rest] == [e["type"] for e in every[1:]]


def test_private_callback_url_is_refused_at_submit(stack: StackState) -> None:
    """callback_url to loopback, private, link-local or localhost answers 422 and writes nothing."""
    api, name = _tenant(stack, stack.env["CALMQ_API_URL"])
    for url in ("http://127.0.0.1:9/hook", "http://localhost/hook", "http://10.1.2.3/x",
                "http://192.168.0.5/x", "http://169.254.169.254/latest", "http://[::1]/x",
                "http://0.0.0.0/x"):
        status, hdrs, body = api.call("POST", "/v1/jobs", {
            "workflow": "summarize", "input": {"text": "x"}, "callback_url": url})
        assert status == 422, (url, body)
        assert hdrs["Content-Type"].startswith("application/problem+json")
        assert body["code"] == "callback_url_forbidden"
    status, _h, body = api.call("POST", "/v1/jobs", {
        "workflow": "summarize", "input": {"text": "x"}, "callback_url": "ftp://example.com/x"})
    assert (status, body["code"]) == (422, "invalid_callback_url")
    with db(stack) as conn:
        row = conn.execute("SELECT count(*) FROM jobs j JOIN tenants t ON t.id = j.tenant_id "
                           "WHERE t.name = %s", (name,)).fetchone()
    assert row == (0,)


def test_dispatcher_refuses_private_target_enqueued_past_the_api(stack: StackState) -> None:
    """A private callback_url that bypassed the API check is refused at send time, once."""
    _api, name = _tenant(stack, stack.env["CALMQ_API_URL"])
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        tenant_id = conn.execute("SELECT id FROM tenants WHERE name = %s", (name,)).fetchone()[0]
        job_id = enqueue(conn, tenant_id=tenant_id, workflow="summarize",
                         input={"text": "x", "mode": "success"},
                         callback_url="http://127.0.0.1:9/never")
    def delivery() -> tuple[Any, ...] | None:
        with db(stack) as conn:
            return conn.execute(
                "SELECT d.status, d.attempts, a.error FROM webhook_deliveries d "
                "JOIN webhook_attempts a ON a.delivery_id = d.id WHERE d.job_id = %s "
                "AND d.status <> 'pending'", (job_id,)).fetchone()

    status, attempts, error = wait_for(delivery, timeout=60, what="the refused delivery")
    assert (status, attempts) == ("failed", 1)
    assert "private or loopback" in error


def test_webhook_is_signed_retried_and_recorded(local_api: tuple[ApiProcess, str]) -> None:
    """A callback fails once, is retried, and its signatures verify with the tenant secret:
    calmq's own, and the Standard Webhooks one through that scheme's reference library."""
    api_process, database_url = local_api
    name = f"hook-{uuid.uuid4().hex[:8]}"
    api = Api(api_process.url, create_tenant(database_url, name))
    secret = tenants.webhook_secret(database_url, name)
    with Receiver(fail_first=1) as receiver:
        job_id = api.submit({"text": "call me back", "mode": "success"},
                            callback_url=receiver.url)
        assert api.call("POST", f"/v1/jobs/{job_id}/cancel")[0] == 200
        wait_for(lambda: len(receiver.calls) >= 2, timeout=60, what="the retried callback")
        headers, body = receiver.calls[-1]
    assert verify(secret, headers, body)
    assert not verify(secret, headers, body + b" ")
    assert not verify("another-tenants-secret", headers, body)
    standard = Webhook(standard_secret(secret))
    assert standard.verify(body, headers)["data"]["job_id"] == job_id
    with pytest.raises(WebhookVerificationError):
        standard.verify(body + b" ", headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(standard_secret("another-tenants-secret")).verify(body, headers)
    first_headers, _ = receiver.calls[0]
    assert first_headers["webhook-id"] == headers["webhook-id"]  # one id across retries
    payload = json.loads(body)
    # Standard Webhooks' {type, timestamp, data} (payload version 2, the default); the
    # timestamp is the event's, so a retry carries the first attempt's.
    assert sorted(payload) == ["data", "timestamp", "type"]
    assert payload["type"] == "job.cancelled"
    assert payload["data"]["job_id"] == job_id
    assert payload["data"]["status"] == "cancelled"
    assert datetime.fromisoformat(payload["timestamp"]).tzinfo is not None
    assert json.loads(receiver.calls[0][1])["timestamp"] == payload["timestamp"]

    def recorded() -> list[tuple[Any, ...]] | None:
        with psycopg.connect(database_url) as conn:
            rows = conn.execute(
                "SELECT d.status, a.attempt, a.status_code FROM webhook_deliveries d "
                "JOIN webhook_attempts a ON a.delivery_id = d.id WHERE d.job_id = %s "
                "ORDER BY a.attempt", (job_id,)).fetchall()
        return rows if rows and rows[0][0] == "delivered" else None

    rows = wait_for(recorded, timeout=30, what="the delivery to be recorded as delivered")
    assert [(r[1], r[2]) for r in rows] == [(1, 500), (2, 204)]


def test_payload_version_1_keeps_the_first_body(stack: StackState) -> None:
    """CALMQ_WEBHOOK_PAYLOAD_VERSION=1 sends calmq's first {event, job} body, signed alike."""
    with _webhook_api(stack, CALMQ_WEBHOOK_PAYLOAD_VERSION="1") as (api_process, database_url):
        name = f"hook1-{uuid.uuid4().hex[:8]}"
        api = Api(api_process.url, create_tenant(database_url, name))
        secret = tenants.webhook_secret(database_url, name)
        with Receiver() as receiver:
            headers, body = _delivered(api, receiver)
    payload = Webhook(standard_secret(secret)).verify(body, headers)
    assert sorted(payload) == ["event", "job"]
    assert payload["event"] == "cancelled"
    assert payload["job"]["status"] == "cancelled"


def _delivered(api: Api, receiver: Receiver) -> tuple[dict[str, str], bytes]:
    """Submit a job calling back to ``receiver``, cancel it, and return the callback."""
    before = len(receiver.calls)
    job_id = api.submit({"text": "rotate", "mode": "success"}, callback_url=receiver.url)
    assert api.call("POST", f"/v1/jobs/{job_id}/cancel")[0] == 200
    wait_for(lambda: len(receiver.calls) > before, timeout=60, what="the callback")
    return receiver.calls[-1]


def test_rotated_secret_signs_with_both_during_the_grace(
        stack: StackState, local_api: tuple[ApiProcess, str]) -> None:
    """After `calmq tenants webhook-secret NAME --rotate`, a receiver holding the old secret
    and one holding the new secret both verify a delivery (Standard Webhooks library);
    Calmq-Signature is the newest's. Once the grace is over only the new secret verifies."""
    api_process, database_url = local_api
    name = f"rotate-{uuid.uuid4().hex[:8]}"
    api = Api(api_process.url, create_tenant(database_url, name))
    old = tenants.webhook_secret(database_url, name)
    env = calmq_env(stack, CALMQ_DATABASE_URL=database_url)
    rotated = calmq(stack, "tenants", "webhook-secret", name, "--rotate", env=env)
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.strip()
    assert new
    assert new != old
    assert new == tenants.webhook_secret(database_url, name)  # the plain command shows it
    assert "previous secret" in rotated.stderr
    with Receiver() as receiver:
        headers, body = _delivered(api, receiver)
        assert len(headers["webhook-signature"].split(" ")) == 2
        for secret in (old, new):
            assert Webhook(standard_secret(secret)).verify(body, headers)["type"] == (
                "job.cancelled")
        assert verify(new, headers, body)
        assert not verify(old, headers, body)

        # The grace is over (as if its time had passed): only the new secret signs.
        with psycopg.connect(database_url) as conn:
            conn.execute("UPDATE tenants SET webhook_secret_previous_until = now() "
                         "- interval '1 second' WHERE name = %s", (name,))
        headers, body = _delivered(api, receiver)
    assert len(headers["webhook-signature"].split(" ")) == 1
    assert Webhook(standard_secret(new)).verify(body, headers)["type"] == "job.cancelled"
    with pytest.raises(WebhookVerificationError):
        Webhook(standard_secret(old)).verify(body, headers)
    assert tenants.webhook_secrets(database_url, name).previous is None


def test_rotation_with_no_grace_drops_the_old_secret_at_once(
        stack: StackState, local_api: tuple[ApiProcess, str]) -> None:
    """--webhook-secret-grace-seconds 0: the next delivery verifies with the new one only."""
    api_process, database_url = local_api
    name = f"rotate0-{uuid.uuid4().hex[:8]}"
    api = Api(api_process.url, create_tenant(database_url, name))
    old = tenants.webhook_secret(database_url, name)
    env = calmq_env(stack, CALMQ_DATABASE_URL=database_url)
    rotated = calmq(stack, "tenants", "webhook-secret", name, "--rotate",
                    "--webhook-secret-grace-seconds", "0", env=env)
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.strip()
    with Receiver() as receiver:
        headers, body = _delivered(api, receiver)
    Webhook(standard_secret(new)).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(standard_secret(old)).verify(body, headers)


def test_a_dead_endpoint_does_not_hold_back_another_tenants_webhooks(
        local_api: tuple[ApiProcess, str]) -> None:
    """Tenant A's 12 callbacks go to an endpoint that accepts the connection and never
    answers (each attempt holds until the 10 s webhook timeout); while they are in flight,
    tenant B's 5 callbacks arrive within 5 s, and A holds at most its 4 slots."""
    api_process, database_url = local_api
    a = Api(api_process.url, create_tenant(database_url, f"dead-{uuid.uuid4().hex[:8]}"))
    b = Api(api_process.url, create_tenant(database_url, f"live-{uuid.uuid4().hex[:8]}"))
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead.listen(256)  # the kernel completes each connect; nothing ever reads or answers
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}/hook"
    try:
        with Receiver() as receiver:
            a_jobs = [a.submit({"text": f"a {n}", "mode": "success"}, callback_url=dead_url)
                      for n in range(12)]
            b_jobs = [b.submit({"text": f"b {n}", "mode": "success"},
                               callback_url=receiver.url) for n in range(5)]
            for job_id in a_jobs:
                assert a.call("POST", f"/v1/jobs/{job_id}/cancel")[0] == 200

            def a_claimed() -> int:
                with psycopg.connect(database_url) as conn:
                    row = conn.execute("SELECT count(*) FROM webhook_deliveries "
                                       "WHERE job_id = ANY(%s::uuid[]) AND attempts >= 1",
                                       (a_jobs,)).fetchone()
                return int(row[0]) if row else 0

            wait_for(a_claimed, timeout=30, what="tenant A's deliveries to be in flight")
            a_started = time.monotonic()
            for job_id in b_jobs:
                assert b.call("POST", f"/v1/jobs/{job_id}/cancel")[0] == 200
            b_started = time.monotonic()
            wait_for(lambda: len(receiver.calls) >= 5, timeout=30,
                     what="tenant B's callbacks")
            took = time.monotonic() - b_started
            claimed = a_claimed()
            held_since = time.monotonic() - a_started
        assert took < 5, f"tenant B's callbacks took {took:.1f} s"
        assert sorted(json.loads(body)["data"]["job_id"] for _h, body in receiver.calls) == (
            sorted(b_jobs))
        if held_since < 9:  # before A's first attempts time out and free their slots
            assert claimed <= 4, claimed
    finally:
        dead.close()
