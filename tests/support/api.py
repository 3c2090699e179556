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
