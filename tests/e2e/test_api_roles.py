"""Key roles on the JSON API (issue 18): each /v1 route that acts needs its role, keys made
without roles keep every one, the CLI makes keys with roles and platform keys, and the
console's cookie reads but never acts on /v1."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest

from calmq.tooling.devstack import StackState
from tests.support.api import Api, console_session
from tests.support.cli import calmq

pytestmark = pytest.mark.e2e


def _key(stack: StackState, *argv: str) -> str:
    done = calmq(stack, "tenants", *argv)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_each_route_needs_its_role_and_keys_without_roles_keep_all(stack: StackState) -> None:
    name = f"roles-{uuid.uuid4().hex[:8]}"
    url = stack.env["CALMQ_API_URL"]
    full = Api(url, _key(stack, "create", name))
    submitter = Api(url, _key(stack, "add-key", name, "--roles", "submit"))
    reviewer = Api(url, _key(stack, "add-key", name, "--roles", "review"))
    operator = Api(url, _key(stack, "add-key", name, "--roles", "operate,review"))
    job = submitter.submit({"text": "roles", "mode": "success"})
    some = str(uuid.uuid4())
    calls = {
        "submit": ("POST", "/v1/jobs", {"workflow": "summarize", "input": {"text": "x"}}),
        "review": ("GET", "/v1/reviews", None),
        "operate": ("GET", "/v1/dead-letters", None),
        "redrive": ("POST", f"/v1/dead-letters/{some}/redrive", {"reason": "r"}),
        "decide": ("POST", f"/v1/jobs/{some}/review", {"decision": "reject"}),
    }
    allowed = {"submit": {"submit"}, "review": {"review", "decide"},
               "operate": {"operate", "redrive", "review", "decide"}}
    for api, label in ((submitter, "submit"), (reviewer, "review"), (operator, "operate")):
        for call, (method, path, body) in calls.items():
            status, _h, answer = api.call(method, path, body)
            if call in allowed[label]:
                assert status != 403, (label, call, answer)
            else:
                assert (status, answer["code"]) == (403, "role_forbidden"), (label, call)
    # Every key reads its tenant's jobs; a key made without roles does everything.
    assert reviewer.job(job)["job_id"] == job
    for method, path, body in calls.values():
        assert full.call(method, path, body)[0] != 403
    assert reviewer.call("POST", f"/v1/jobs/{job}/cancel")[0] == 403
    assert operator.call("POST", f"/v1/jobs/{job}/cancel")[0] in (200, 409)


def test_the_cli_lists_roles_and_makes_platform_keys(stack: StackState) -> None:
    name = f"roles-{uuid.uuid4().hex[:8]}"
    _key(stack, "create", name)
    _key(stack, "add-key", name, "--roles", "review")
    bad = calmq(stack, "tenants", "add-key", name, "--roles", "admin")
    assert bad.returncode != 0
    assert "unknown role" in bad.stderr
    listed = calmq(stack, "tenants", "list", name, "-o", "jsonl")
    keys = json.loads(listed.stdout.strip().splitlines()[-1])["keys"]
    assert [k["roles"] for k in keys] == [["submit", "review", "operate"], ["review"]]
    assert {k["role"] for k in keys} == {"tenant"}
    platform = _key(stack, "platform-key")
    assert platform.startswith("cq_")
    listed = calmq(stack, "tenants", "list", "platform", "-o", "jsonl")
    assert any(k["platform"] for k in json.loads(listed.stdout.strip())["keys"])


def test_the_console_cookie_reads_but_never_acts_on_v1(stack: StackState) -> None:
    """A signed-in console's cookie reads /v1 (GET) but cannot cancel or submit: 401."""
    name = f"roles-{uuid.uuid4().hex[:8]}"
    key = _key(stack, "create", name)
    url = stack.env["CALMQ_API_URL"]
    job = Api(url, key).submit({"text": "cookie", "mode": "success"})
    # The cookie a console sign-in sets: a session token of its own, never the key.
    cookie = {"Cookie": f"calmq_console={console_session(url, key)}"}

    def call(method: str, path: str) -> int:
        req = urllib.request.Request(url + path, method=method, headers=cookie,
                                     data=b"{}" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    assert call("GET", f"/v1/jobs/{job}") == 200
    assert call("POST", f"/v1/jobs/{job}/cancel") == 401
    assert call("POST", "/v1/jobs") == 401
