"""The console's sign-in session against the running API and PostgreSQL (issue 27): the
cookie holds a random token of its own with an expiry, stored server-side as a hash, and
revocable; never the API key."""

from __future__ import annotations

import hashlib
import re
import urllib.error
import urllib.parse
import urllib.request
import uuid

import psycopg
import pytest

from calmq.data import tenants
from calmq.producers.console.session import COOKIE
from calmq.tooling.devstack import StackState
from tests.support.api import Api, NoRedirect, console_session, create_tenant
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e


def _get(url: str, session: str) -> tuple[int, str, dict[str, str]]:
    """A GET with the session cookie, redirects not followed: (status, body, headers)."""
    req = urllib.request.Request(url, headers={"Cookie": f"{COOKIE}={session}"})
    try:
        with urllib.request.build_opener(NoRedirect).open(req, timeout=30) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def _post(url: str, session: str, form: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=urllib.parse.urlencode(form).encode(),
                                 method="POST", headers={
                                     "Cookie": f"{COOKIE}={session}",
                                     "Content-Type": "application/x-www-form-urlencoded"})
    try:
        with urllib.request.build_opener(NoRedirect).open(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _csrf(page: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, "the page has no form token"
    return match.group(1)


def test_the_cookie_is_a_session_that_expires_and_is_revoked_server_side(
        stack: StackState) -> None:
    """Signing in gives a cookie that is not the key, lasts console_session_seconds and is
    stored only as its hash; it reads console pages and GET /v1. Signing out ends it in the
    database (the copied cookie no longer works), as do its expiry and revoking its key. A
    form token with non-ASCII text is refused with 403, not a 500."""
    url, db = stack.env["CALMQ_API_URL"], stack.env["CALMQ_DATABASE_URL"]
    name = f"session-{uuid.uuid4().hex[:8]}"
    key = create_tenant(db, name)
    session = console_session(url, key)
    assert session != key
    assert key not in session
    status, page, _h = _get(url + "/console/overview", session)
    assert status == 200
    assert f"tenant {name}" in page
    assert _get(url + "/v1/jobs?limit=1", session)[0] == 200  # the pages' SSE reads
    with psycopg.connect(db) as conn:
        stored = conn.execute(
            "SELECT s.token_hash, extract(epoch FROM s.expires_at - s.created_at)::int"
            " FROM console_sessions s JOIN api_keys k ON k.id = s.key_id"
            " JOIN tenants t ON t.id = k.tenant_id WHERE t.name = %s", (name,)).fetchall()
    assert stored == [(hashlib.sha256(session.encode()).digest(), 8 * 3600)]

    assert _post(url + "/console/sign-out", session, {"csrf": "\u00e9t\u00e9"}) == 403
    assert _post(url + "/console/sign-out", session, {"csrf": _csrf(page)}) == 303
    status, _b, headers = _get(url + "/console/overview", session)  # the cookie, kept
    assert (status, headers["Location"].split("?")[0]) == (303, "/console/sign-in")
    assert _get(url + "/v1/jobs?limit=1", session)[0] == 401

    expiring = console_session(url, key)
    with psycopg.connect(db) as conn:
        conn.execute("UPDATE console_sessions SET expires_at = now() - interval '1 second'"
                     " WHERE token_hash = %s", (hashlib.sha256(expiring.encode()).digest(),))
    assert _get(url + "/console/overview", expiring)[0] == 303

    revoked = console_session(url, key)
    assert _get(url + "/console/overview", revoked)[0] == 200
    tenants.revoke_keys(db, name)
    wait_for(lambda: _get(url + "/console/overview", revoked)[0] == 303, timeout=15,
             what="the revoked key's session to end")
    assert Api(url, key).call("GET", "/v1/jobs?limit=1")[0] == 401
