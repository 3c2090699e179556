"""Tenant-visible errors name no internal host: a job whose provider cannot be reached
shows its error and history over the API without the provider's host name, while the
job's row keeps the whole text for operators (``calmq dlq show``)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest

from calmq.tooling.devstack import StackState
from tests.support.api import console_session
from tests.support.waiting import wait_for
from tests.support.workers import BASE, Env, forwarded_env, job_rows

pytestmark = pytest.mark.integration

# .invalid never resolves (RFC 6761): the connection fails at once, naming the host.
HOST = "llm-gateway.corp.invalid"


@pytest.fixture(scope="module")
def env(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from forwarded_env(stack, tmp_path_factory.mktemp("hidden-hosts-logs"))


def test_a_connection_error_shows_no_internal_host_to_the_tenant(env: Env) -> None:
    """The provider's host is unreachable: GET /v1/jobs/{id}, its events, the job list and
    the console's job page show the error without the host name; the row keeps it."""
    pool = env.pool("hosts")
    env.procs.worker(pool, **BASE, provider="openai", provider_url=f"http://{HOST}:8443",
                     model="gpt-4o-mini")
    [job_id] = env.submit(pool, {"text": "where is my model"}, max_attempts=3)
    row = wait_for(lambda: (r := job_rows(env.db, [job_id])[job_id])["error"] and r,
                   timeout=90, what="the job's first error")
    assert HOST in str(row["error"]) or HOST in str(row["errors"]), row
    view = env.api.job(job_id)
    assert view["error"] is not None
    assert view["error"]["code"] == "connection_error"
    assert HOST not in str(view), view
    _status, _h, listed = env.api.call("GET", "/v1/jobs?limit=50")
    assert HOST not in str(listed)
    # The console shows the tenant the same: its job page and the page's JSON.
    cookie = console_session(env.api.base_url, env.api.key)
    for path in (f"/console/jobs/{job_id}", f"/console/jobs/{job_id}.json"):
        req = urllib.request.Request(env.api.base_url + path,
                                     headers={"Cookie": f"calmq_console={cookie}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            page = resp.read().decode()
        assert "connection_error" in page, path
        assert HOST not in page, path
