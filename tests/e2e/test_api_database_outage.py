"""The API while its database is away: 503 with Retry-After, never 500, never the driver's
text; ready again once the database is back.

An API process of its own reaches the session's PostgreSQL through a TCP fault proxy that
the test cuts (every connection dropped, new ones refused) and restores.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from calmq.tooling.devstack import StackState
from tests.support.api import create_tenant
from tests.support.faultproxy import FaultProxy
from tests.support.intake import ApiProcess, running_api
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def proxied(stack: StackState) -> Iterator[tuple[FaultProxy, ApiProcess, str]]:
    url = stack.env["CALMQ_DATABASE_URL"]
    info = conninfo_to_dict(url)
    with FaultProxy(str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432)) as proxy:
        via_proxy = make_conninfo(url, host="127.0.0.1", port=str(proxy.port))
        key = create_tenant(url, f"outage-{uuid.uuid4().hex[:8]}")
        # No webhook dispatcher or samplers to muddy the log; the pool gives up quickly.
        with running_api(stack, {"CALMQ_DATABASE_URL": via_proxy,
                                 "CALMQ_WEBHOOK_DISPATCHER": "false"}) as api:
            yield proxy, api, key


def _get(url: str, key: str | None = None) -> tuple[int, dict[str, str], Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"{}")


def test_database_outage_is_503_with_retry_after_and_no_driver_text(
    proxied: tuple[FaultProxy, ApiProcess, str], stack: StackState
) -> None:
    """Cut: /readyz and a job read answer 503 database_unavailable (with Retry-After on the
    read) and no PostgreSQL text; restored: both answer 200 again, without a restart."""
    proxy, api, key = proxied
    job = f"{api.url}/v1/jobs/{uuid.uuid4()}"
    assert _get(api.url + "/readyz")[0] == 200
    assert _get(job, key)[0] == 404  # reachable: an unknown job
    proxy.cut()
    status, _h, body = _get(api.url + "/readyz")
    assert (status, body["code"]) == (503, "database_unavailable")
    status, headers, body = wait_for(
        lambda: (r := _get(job, key))[0] != 404 and r, timeout=60,
        what="the job read to notice the outage")
    assert (status, body["code"]) == (503, "database_unavailable"), body
    assert headers.get("Retry-After") == "1"
    for answer in (body, _get(api.url + "/readyz")[2]):
        text = json.dumps(answer).lower()
        assert "connection" not in text
        assert "127.0.0.1" not in text
        assert "postgres" not in text.replace("postgresql does not answer", "")
    proxy.restore()
    wait_for(lambda: _get(api.url + "/readyz")[0] == 200, timeout=60,
             what="readiness after the database came back")
    assert _get(job, key)[0] == 404
