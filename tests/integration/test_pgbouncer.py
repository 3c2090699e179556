"""calmq behind PgBouncer in transaction mode (Debian's package, `calmq dev up --pgbouncer`).

The API, the workers, the forwarder and the CLI reach PostgreSQL through PgBouncer
(``CALMQ_DATABASE_POOLER=transaction``: psycopg prepares no statement, since a statement
prepared on one server connection would run on another); the relay's replication and the
API's LISTEN session connect directly (``CALMQ_RELAY_DATABASE_URL``,
``CALMQ_DIRECT_DATABASE_URL``). PgBouncer runs with ``max_client_conn`` well above the pool
size, so server connections really are shared between clients transaction by transaction.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import urllib.error
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from calmq.tooling.devstack import Stack, StackState
from calmq.tooling.devstack.pgbouncer import pgbouncer_binary
from tests.support.api import Api
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pooled() -> Iterator[StackState]:
    """The local stack with PgBouncer, every service going through it as the docs say."""
    in_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    try:
        pgbouncer_binary()
    except Exception as exc:  # noqa: BLE001 - a missing package is reported, not raised
        if in_ci:
            pytest.fail(f"PgBouncer is missing in CI (make pgbouncer): {exc}", pytrace=False)
        pytest.skip(f"PgBouncer is not installed here (make pgbouncer): {exc}")
    home = Path(tempfile.mkdtemp(prefix="calmq-pgbouncer-"))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    # Only a NOTIFY (on the direct LISTEN session) can make a revoked key fail at once.
    environ["CALMQ_AUTH_CACHE_SECONDS"] = "600"
    stack = Stack(home, environ, pooler=True)
    try:
        state = stack.up(log=lambda _m: None)
    except Exception as exc:  # noqa: BLE001 - any start failure is reported the same way
        if in_ci:
            pytest.fail(f"the PgBouncer stack could not start in CI: {exc}", pytrace=False)
        pytest.skip(f"the PgBouncer stack could not start here: {exc}")
    try:
        yield state
    finally:
        stack.down(log=lambda _m: None)


def _calmq(state: StackState, *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    return subprocess.run([sys.executable, "-m", "calmq.cli", *args],
                          env={**base, **state.env}, capture_output=True, text=True,
                          timeout=60, check=False)


def test_jobs_complete_with_every_service_behind_pgbouncer(pooled: StackState) -> None:
    """100 jobs (every statement run far past psycopg's prepare threshold on shared server
    connections) are accepted, claimed and completed through PgBouncer."""
    assert pooled.env["CALMQ_DATABASE_POOLER"] == "transaction"
    assert pooled.env["CALMQ_DATABASE_URL"] != pooled.env["CALMQ_DIRECT_DATABASE_URL"]
    created = _calmq(pooled, "tenants", "create", f"pgb-{uuid.uuid4().hex[:6]}")
    assert created.returncode == 0, created.stderr
    api = Api(pooled.env["CALMQ_API_URL"], created.stdout.strip().splitlines()[-1])
    ids = [api.submit({"text": f"pooled {i}", "mode": "success"}) for i in range(100)]

    def done() -> bool:
        with psycopg.connect(pooled.env["CALMQ_DIRECT_DATABASE_URL"]) as conn:
            row = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s::uuid[]) AND "
                               "status = 'completed'", (ids,)).fetchone()
        return row is not None and row[0] == len(ids)

    wait_for(done, timeout=120, what="100 jobs completed behind PgBouncer")
    shown = _calmq(pooled, "jobs", "show", ids[0])  # the CLI through PgBouncer too
    assert shown.returncode == 0, shown.stderr
    assert "completed" in shown.stdout
    for name in ("api", "worker", "forwarder"):
        log = Path(pooled.data_dir, "logs", f"{name}.log").read_text(errors="replace")
        assert "prepared statement" not in log, f"{name}: {log[-2000:]}"


def test_the_relay_and_listen_connect_directly(pooled: StackState) -> None:
    """The relay streams on the server itself (not through PgBouncer), and a revoked key is
    refused at once: the API's LISTEN session got the NOTIFY, though its cache holds 600 s."""
    with psycopg.connect(pooled.env["CALMQ_DIRECT_DATABASE_URL"]) as conn:
        walsenders = conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone()
        listening = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE query LIKE "
                                 "'LISTEN %%' AND application_name <> 'pgbouncer'"
                                 ).fetchone()
    assert walsenders == (1,)
    assert listening is not None
    assert listening[0] >= 1
    name = f"pgb-{uuid.uuid4().hex[:6]}"
    created = _calmq(pooled, "tenants", "create", name)
    api = Api(pooled.env["CALMQ_API_URL"], created.stdout.strip().splitlines()[-1])
    api.submit({"text": "before the revocation", "mode": "success"})  # the key is cached
    revoked = _calmq(pooled, "tenants", "revoke-key", name)
    assert revoked.returncode == 0, revoked.stderr

    def refused() -> bool:
        try:
            status, _h, _b = api.call("GET", "/v1/jobs?limit=1")
        except urllib.error.HTTPError as exc:
            status = exc.code
        return status == 401

    wait_for(refused, timeout=10, what="the revoked key refused (NOTIFY through LISTEN)")


def test_without_a_direct_url_the_api_refuses_to_start_behind_a_pooler(
        pooled: StackState) -> None:
    """CALMQ_DATABASE_POOLER=transaction without CALMQ_DIRECT_DATABASE_URL: the API exits at
    start with an error naming the setting, instead of a LISTEN that never hears a thing."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    env = {k: v for k, v in pooled.env.items() if k != "CALMQ_DIRECT_DATABASE_URL"}
    result = subprocess.run([sys.executable, "-m", "calmq.cli", "api", "--api-port", "0"],
                            env={**base, **env}, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode != 0
    assert "CALMQ_DIRECT_DATABASE_URL" in result.stderr
