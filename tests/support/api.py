"""A small synchronous client for the calmq API, for tests."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

from calmq.data import Store


class Api:
    def __init__(self, base_url: str, key: str) -> None:
        self.base_url = base_url
        self.key = key

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        hdrs.update(headers or {})
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                text = resp.read()
                return resp.status, dict(resp.headers), json.loads(text) if text else None
        except urllib.error.HTTPError as exc:
            text = exc.read()
            try:
                parsed = json.loads(text) if text else None
            except ValueError:
                parsed = text.decode("utf-8", "replace")
            return exc.code, dict(exc.headers), parsed

    def submit(self, input_: dict[str, Any], **fields: Any) -> str:
        status, _h, body = self.call(
            "POST", "/v1/jobs", {"workflow": "summarize", "input": input_, **fields}
        )
        assert status == 202, body
        return str(body["job_id"])

    def job(self, job_id: str) -> dict[str, Any]:
        status, _h, body = self.call("GET", f"/v1/jobs/{job_id}")
        assert status == 200, body
        return dict(body)


def create_tenant(database_url: str, name: str) -> str:
    async def create() -> str:
        store = Store(database_url, max_size=1)
        await store.open()
        try:
            _tenant, key = await store.tenants.create(name)
            return key
        finally:
            await store.close()

    return asyncio.run(create())


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """urllib without following redirects: a 3xx is raised as an HTTPError."""

    def redirect_request(self, *_args: Any, **_kwargs: Any) -> None:
        return None


def console_session(base_url: str, key: str) -> str:
    """Sign ``key`` in to the console as a browser would (the sign-in form's CSRF cookie
    and token, then the POST); returns the session cookie's value."""
    import http.cookies
    import re
    import urllib.parse

    with urllib.request.urlopen(base_url + "/console/sign-in", timeout=30) as resp:
        page = resp.read().decode()
        jar = http.cookies.SimpleCookie(resp.headers.get("Set-Cookie", ""))
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, "the sign-in form has no CSRF token"
    form = urllib.parse.urlencode({"csrf": match.group(1), "api_key": key}).encode()
    req = urllib.request.Request(
        base_url + "/console/sign-in", data=form, method="POST",
        headers={"Cookie": "; ".join(f"{k}={v.value}" for k, v in jar.items()),
                 "Content-Type": "application/x-www-form-urlencoded"})
    try:
        urllib.request.build_opener(NoRedirect).open(req, timeout=30)
    except urllib.error.HTTPError as exc:
        answer = exc  # the 303 (redirects are not followed)
    else:
        raise AssertionError("sign-in did not redirect")
    assert answer.code == 303, f"sign-in answered {answer.code}"
    cookies: http.cookies.SimpleCookie = http.cookies.SimpleCookie()
    for header in answer.headers.get_all("Set-Cookie") or []:
        cookies.load(header)
    return cookies["calmq_console"].value


def lifecycle(events: list[dict[str, Any]]) -> list[str]:
    """A job's event types without a fair-share hold in the waiting room and its end: fair
    share is on by default, and a worker that has just started or taken over partitions may
    hold a job when it finds no free slot; that is not the lifecycle most tests are about."""
    return [e["type"] for e in events if e["type"] not in ("waiting", "resumed")]
