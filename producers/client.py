"""The client library for upstream services.

Two ways in:

* ``enqueue(conn, ...)`` / ``enqueue_async(conn, ...)`` write the job, its first history
  event and its outbox row on the CALLER's psycopg connection, inside the caller's open
  transaction: the business write and the job commit or roll back together (the outbox
  pattern). Nothing is committed here; the relay sees the job when the caller commits.
* ``Client``: an async HTTP client of the intake API (aiohttp), for services that talk
  to calmq over the network.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import psycopg

from calmq.data.jobs import NewJob, insert_job, insert_job_sync
from calmq.errors import ContractError
from calmq.producers.intake import prepare
from calmq.workflows import Workflow, builtin_workflows, find_workflow

__all__ = ["ApiError", "Client", "enqueue", "enqueue_async"]


def _prepared(  # noqa: PLR0917 - private, called with every field of the public two
    tenant_id: uuid.UUID | str, workflow: str, input: dict[str, Any] | None,
    input_ref: str | None, priority: str, deadline_seconds: int | None,
    callback_url: str | None, metadata: Mapping[str, Any] | None,
    workflows: Mapping[str, Workflow] | None,
) -> NewJob:
    if (input is None) == (input_ref is None):
        raise ContractError("pass exactly one of input and input_ref", code="invalid_body",
                            status=422)
    if priority not in ("interactive", "bulk"):
        raise ContractError("priority is interactive or bulk", code="invalid_body", status=422)
    wf = find_workflow(workflow, dict(workflows or builtin_workflows()))
    data = wf.validate_input(input) if input is not None else None
    return prepare(wf, uuid.UUID(str(tenant_id)), input=data, input_ref=input_ref,
                   priority=priority, deadline_seconds=deadline_seconds,
                   callback_url=callback_url, metadata=metadata)


def enqueue(
    conn: psycopg.Connection[Any],
    *,
    tenant_id: uuid.UUID | str,
    workflow: str,
    input: dict[str, Any] | None = None,
    input_ref: str | None = None,
    priority: str = "bulk",
    deadline_seconds: int | None = None,
    callback_url: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    workflows: Mapping[str, Workflow] | None = None,
) -> uuid.UUID:
    """Insert a job in the caller's transaction on ``conn``; returns its id. Does not commit.

    The input is validated exactly as the API validates it (ContractError on bad input).
    ``callback_url`` is not checked for private addresses here: the caller is inside the
    trust boundary; the webhook dispatcher still refuses them unless allowed.
    """
    job = _prepared(tenant_id, workflow, input, input_ref, priority, deadline_seconds,
                    callback_url, metadata, workflows)
    insert_job_sync(conn, job)
    return job.id


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any],
    *,
    tenant_id: uuid.UUID | str,
    workflow: str,
    input: dict[str, Any] | None = None,
    input_ref: str | None = None,
    priority: str = "bulk",
    deadline_seconds: int | None = None,
    callback_url: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    workflows: Mapping[str, Workflow] | None = None,
) -> uuid.UUID:
    """``enqueue`` for an async psycopg connection."""
    job = _prepared(tenant_id, workflow, input, input_ref, priority, deadline_seconds,
                    callback_url, metadata, workflows)
    await insert_job(conn, job)
    return job.id


class ApiError(ContractError):
    """A problem+json answer of the API (``code`` and ``status`` as the API sent them)."""


class Client:
    """Async client of the intake API. Use as ``async with Client(url, key) as api:``."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0,
                 session: aiohttp.ClientSession | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._own = session is None
        self._session = session or aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout))

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *_exc: type[BaseException] | BaseException | TracebackType | None
                        ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own:
            await self._session.close()

    async def _call(self, method: str, path: str, *, expect: int = 200,
                    headers: Mapping[str, str] | None = None, **kw: Any) -> Any:
        async with self._session.request(method, self.base_url + path,
                                         headers={**self._headers, **(headers or {})},
                                         **kw) as resp:
            text = await resp.read()
            if resp.status != expect:
                raise _error(resp.status, text)
            return json.loads(text) if text else None

    async def submit(self, workflow: str, input: dict[str, Any] | None = None,
                     *, idempotency_key: str | None = None, **fields: Any) -> dict[str, Any]:
        """POST /v1/jobs; returns ``{"job_id", "status", "status_url"}``."""
        body = {"workflow": workflow, **fields}
        if input is not None:
            body["input"] = input
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        result: dict[str, Any] = await self._call("POST", "/v1/jobs", json=body, expect=202,
                                                  headers=headers)
        return result

    async def submit_file(self, workflow: str, path: Path, *, content_type: str =
                          "application/octet-stream", **fields: Any) -> dict[str, Any]:
        """Multipart submit; the file is streamed from disk, never read whole."""
        with path.open("rb") as fh:
            form = aiohttp.FormData()
            form.add_field("workflow", workflow)
            for name, value in fields.items():
                form.add_field(name, value if isinstance(value, str) else json.dumps(value))
            form.add_field("file", fh, filename=path.name, content_type=content_type)
            result: dict[str, Any] = await self._call("POST", "/v1/jobs", data=form, expect=202)
        return result

    async def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", f"/v1/jobs/{job_id}")
        return result

    async def list_jobs(self, **filters: str | int) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "GET", "/v1/jobs", params={k: str(v) for k, v in filters.items()})
        return result

    async def cancel(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("POST", f"/v1/jobs/{job_id}/cancel")
        return result

    async def delete(self, job_id: str) -> None:
        await self._call("DELETE", f"/v1/jobs/{job_id}", expect=204)

    async def artifact(self, job_id: str) -> AsyncIterator[bytes]:
        """The artifact's bytes, chunk by chunk."""
        async with self._session.get(f"{self.base_url}/v1/jobs/{job_id}/artifact",
                                     headers=self._headers) as resp:
            if resp.status != 200:
                raise _error(resp.status, await resp.read())
            async for chunk in resp.content.iter_chunked(64 * 1024):
                yield chunk

    async def events(self, job_id: str, *, after: int = 0) -> AsyncIterator[dict[str, Any]]:
        """The job's events as the SSE stream sends them, until the job is terminal."""
        headers = {**self._headers, "Accept": "text/event-stream"}
        if after:
            headers["Last-Event-ID"] = str(after)
        async with self._session.get(f"{self.base_url}/v1/jobs/{job_id}/events",
                                     headers=headers) as resp:
            if resp.status != 200:
                raise _error(resp.status, await resp.read())
            fields: dict[str, str] = {}
            async for raw in resp.content:
                line = raw.decode().rstrip("\r\n")
                if line:
                    if not line.startswith(":"):
                        name, _, value = line.partition(":")
                        fields[name] = value.removeprefix(" ")
                    continue
                if fields.get("event") == "end":
                    return
                if "data" in fields:
                    yield {"id": fields.get("id"), **json.loads(fields["data"])}
                fields = {}


def _error(status: int, text: bytes) -> ApiError:
    try:
        body = json.loads(text)
        return ApiError(str(body.get("detail")), code=str(body.get("code")), status=status)
    except (ValueError, AttributeError):
        return ApiError(text.decode("utf-8", "replace")[:500], code="http_error", status=status)
