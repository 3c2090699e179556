"""The TypeScript client (clients/typescript) under Node's test runner, against the real stack.

The package is built (npm ci, npm run build: the client, its tests and the React example,
all type-checked by tsc), then ``node --test`` runs its compiled tests with the stack's
API, a new tenant's key, an API of this test's own that the node test has killed with
SIGKILL and restarted mid-stream (through a small control endpoint here), and an API that
may call back to 127.0.0.1 for a real webhook delivery. Every node test must pass and none
may be skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
import pytest

from calmq.data import tenants
from calmq.data.migrations import migrate
from calmq.tooling.devstack import StackState
from tests.integration.test_client_resilience import Restartable
from tests.support.api import create_tenant
from tests.support.intake import ApiProcess, running_api
from tests.support.npm import built_client, node

# The stack, two APIs of the test's own, a build (a no-op after `make typescript`) and the
# node run: on a loaded machine more than the default five minutes.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture
def restartable(stack: StackState) -> Iterator[tuple[Restartable, str]]:
    """An API of the test's own, and the URL a POST to which kills -9 and restarts it."""
    api = Restartable(stack)

    class Control(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body: dict[str, Any]
            try:
                api.kill_and_restart()
                status, body = 200, {"restarts": api.restarts}
            except Exception as exc:  # noqa: BLE001 - reported to the node test, which fails
                status, body = 500, {"error": repr(exc)}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_a: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Control)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api, f"http://127.0.0.1:{server.server_address[1]}/restart"
    finally:
        server.shutdown()
        server.server_close()
        api.stop()


@pytest.fixture
def webhook_api(stack: StackState) -> Iterator[tuple[ApiProcess, str]]:
    """An API that may call back to 127.0.0.1, on a database of its own (as in
    tests/e2e/test_api_notifications.py: the session API, which refuses private targets,
    would otherwise claim the delivery too), and that database's URL."""
    name = f"calmq_tshooks_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = stack.env["CALMQ_DATABASE_URL"].rsplit("/", 1)[0] + "/" + name
    migrate(url)
    with running_api(stack, {"CALMQ_DATABASE_URL": url, "CALMQ_WEBHOOK_ALLOW_PRIVATE": "true",
                             "CALMQ_WEBHOOK_BACKOFF_SECONDS": "0.2"}) as api:
        yield api, url


def test_the_typescript_client_passes_its_node_tests_against_the_stack(
        stack: StackState, restartable: tuple[Restartable, str],
        webhook_api: tuple[ApiProcess, str]) -> None:
    """`node --test` of clients/typescript passes with no test skipped: a streamed draft's
    output equals its artifact, the stream resumes across a kill -9 of the API with no delta
    lost or repeated, and a real webhook delivery verifies with the tenant's secret."""
    package = built_client()
    database_url = stack.env["CALMQ_DATABASE_URL"]
    api, restart_url = restartable
    hooks, hooks_database = webhook_api
    hooks_tenant = f"tshook-{uuid.uuid4().hex[:8]}"
    hooks_key = create_tenant(hooks_database, hooks_tenant)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    env.update({
        "CALMQ_API_URL": stack.env["CALMQ_API_URL"],
        "CALMQ_API_KEY": create_tenant(database_url, f"ts-{uuid.uuid4().hex[:8]}"),
        "CALMQ_TEST_RESTARTABLE_API_URL": api.url,
        "CALMQ_TEST_RESTART_URL": restart_url,
        "CALMQ_TEST_WEBHOOK_API_URL": hooks.url,
        "CALMQ_TEST_WEBHOOK_API_KEY": hooks_key,
        "CALMQ_TEST_WEBHOOK_SECRET": tenants.webhook_secret(hooks_database, hooks_tenant),
    })
    result = subprocess.run([node(), "--test", "--test-reporter=tap", "build/test/"],
                            cwd=package, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    report = f"{result.stdout[-12000:]}\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    assert "\n# fail 0" in result.stdout, report
    assert "\n# skipped 0" in result.stdout, report
    assert api.restarts == 1, report  # the kill really happened
