"""The client library for upstream services.

Two ways in:

* ``enqueue(conn, ...)`` / ``enqueue_async(conn, ...)`` write the job, its first history
  event and its outbox row on the CALLER's psycopg connection, inside the caller's open
  transaction: the business write and the job commit or roll back together (the outbox
  pattern). Nothing is committed here; the relay sees the job when the caller commits.
* ``Client``: an async HTTP client of the intake API (aiohttp), for services that talk
  to calmq over the network. It rides out a bad minute: a dropped connection, a 429 or a
  502/503/504 is retried with the project's jittered backoff (never sooner than the
  ``Retry-After`` the API sent), a submit always carries an ``Idempotency-Key`` (so a
  retried submit is one job), and the SSE stream resumes with ``Last-Event-ID``.
  ``submit(..., wait=seconds)`` asks for the answer in the same request when the job is
  fast (``Prefer: wait``); ``events`` also yields a streamed step's text as it is written
  (``output.delta``, and ``reset`` when a new attempt starts over).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import psycopg

from calmq.data.jobs import NewJob, insert_job, insert_job_sync
from calmq.errors import ContractError
from calmq.lanes import choose_lane
from calmq.limits import MAX_METADATA_BYTES, check_concurrency_key, check_metadata
from calmq.producers.intake import prepare
from calmq.retrying import Backoff
from calmq.storable import non_finite
from calmq.workflows import Workflow, builtin_workflows, find_workflow

__all__ = ["ApiError", "Client", "RetryPolicy", "enqueue", "enqueue_async"]

_T = TypeVar("_T")

# What a retry may cure: the API or the network was away, the API shed load (503 while its
# database is unreachable, 429 for the tenant's rate), or a proxy in front answered for it.
_RETRY_STATUSES = frozenset({429, 502, 503, 504})
_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                      asyncio.TimeoutError)


def _prepared(  # noqa: PLR0917 - private, called with every field of the public two
    tenant_id: uuid.UUID | str, workflow: str, input: dict[str, Any] | None,
    input_ref: str | None, priority: str, deadline_seconds: int | None,
    callback_url: str | None, metadata: Mapping[str, Any] | None,
    workflows: Mapping[str, Workflow] | None, lane: str | None = None,
    max_metadata_bytes: int = MAX_METADATA_BYTES, concurrency_key: str | None = None,
) -> NewJob:
    if (input is None) == (input_ref is None):
        raise ContractError("pass exactly one of input and input_ref", code="invalid_body",
                            status=422)
    if priority not in ("interactive", "bulk"):
        raise ContractError("priority is interactive or bulk", code="invalid_body", status=422)
    # The API's limit on metadata holds for a job written directly too: its events carry it.
    check_metadata(metadata, max_metadata_bytes)
    check_concurrency_key(concurrency_key)
    # jsonb refuses infinity and NaN: found here, not as an error that aborts the caller's
    # own transaction.
    for name, value in (("metadata", metadata), ("input", input)):
        found = non_finite(value, name)
        if found is not None:
            raise ContractError(f"{found} is a number that is not finite",
                                code="non_finite_number")
    wf = find_workflow(workflow, dict(workflows or builtin_workflows()))
    chosen = choose_lane(lane, priority, deadline_seconds, bulk_lane=wf.bulk_lane)
    data = wf.validate_input(input) if input is not None else None
    if input_ref is not None:
        # The object's type and size are checked by the API only (this client writes the
        # row directly and reads no store); the worker reads it bounded by the workflow's
        # limit all the same.
        wf.accepts_reference()
    return prepare(wf, uuid.UUID(str(tenant_id)), input=data, input_ref=input_ref,
                   priority=priority, deadline_seconds=deadline_seconds,
                   callback_url=callback_url, metadata=metadata, lane=chosen,
                   concurrency_key=concurrency_key)


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
    lane: str | None = None,
    max_metadata_bytes: int = MAX_METADATA_BYTES,
    concurrency_key: str | None = None,
) -> uuid.UUID:
    """Insert a job in the caller's transaction on ``conn``; returns its id. Does not commit.

    The input is validated exactly as the API validates it (ContractError on bad input),
    and ``metadata`` is held to ``max_metadata_bytes`` as the job's events carry it (the
    API's setting max_metadata_bytes; ContractError ``metadata_too_large``).
    ``callback_url`` is not checked for private addresses here: the caller is inside the
    trust boundary; the webhook dispatcher still refuses them unless allowed.
    """
    job = _prepared(tenant_id, workflow, input, input_ref, priority, deadline_seconds,
                    callback_url, metadata, workflows, lane, max_metadata_bytes,
                    concurrency_key)
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
    lane: str | None = None,
    max_metadata_bytes: int = MAX_METADATA_BYTES,
    concurrency_key: str | None = None,
) -> uuid.UUID:
    """``enqueue`` for an async psycopg connection."""
    job = _prepared(tenant_id, workflow, input, input_ref, priority, deadline_seconds,
                    callback_url, metadata, workflows, lane, max_metadata_bytes,
                    concurrency_key)
    await insert_job(conn, job)
    return job.id


class ApiError(ContractError):
    """A problem+json answer of the API (``code`` and ``status`` as the API sent them).

    ``retry_after``: the seconds the API asked to wait (its ``Retry-After``), if any."""

    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long the client keeps trying: ``attempts`` tries in all, within ``max_elapsed``
    seconds, pausing per ``backoff`` (band-jittered, growing) or longer if the API says so.
    ``RetryPolicy(attempts=1)`` turns retrying off."""

    attempts: int = 8
    max_elapsed: float = 120.0
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=0.2, maximum=10.0))
    statuses: frozenset[int] = _RETRY_STATUSES


class _Retry(Exception):
    """A try that may be repeated, and the least time to wait before the next."""

    def __init__(self, cause: BaseException, wait: float = 0.0) -> None:
        super().__init__(str(cause))
        self.cause, self.wait = cause, wait


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class Client:
    """Async client of the intake API. Use as ``async with Client(url, key) as api:``."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0,
                 session: aiohttp.ClientSession | None = None,
                 retry: RetryPolicy | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
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

    async def _retrying(self, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``attempt`` until it succeeds, raises something final, or the policy ends."""
        policy = self.retry
        started = time.monotonic()
        tries = 0
        while True:
            tries += 1
            try:
                return await attempt()
            except _Retry as retry:
                pause = max(policy.backoff.delay(tries), retry.wait)
                if (tries >= policy.attempts
                        or time.monotonic() - started + pause > policy.max_elapsed):
                    raise retry.cause from None
                await asyncio.sleep(pause)

    async def _call(self, method: str, path: str, *, expect: int | tuple[int, ...] = 200,
                    headers: Mapping[str, str] | None = None, retry: bool = True,
                    **kw: Any) -> Any:
        """One API call; with ``retry`` (safe to repeat: a GET, or a submit with its
        idempotency key) a dropped connection or a retryable status is tried again."""
        async def once() -> Any:
            try:
                async with self._session.request(
                        method, self.base_url + path,
                        headers={**self._headers, **(headers or {})}, **kw) as resp:
                    text = await resp.read()
                    if resp.status in (expect if isinstance(expect, tuple) else (expect,)):
                        return json.loads(text) if text else None
                    error = _error(resp.status, text)
                    error.retry_after = _retry_after(resp.headers.get("Retry-After"))
            except _CONNECTION_ERRORS as exc:
                if retry:
                    raise _Retry(exc) from exc
                raise
            if retry and error.status in self.retry.statuses:
                raise _Retry(error, error.retry_after or 0.0)
            raise error

        return await self._retrying(once)

    async def submit(self, workflow: str, input: dict[str, Any] | None = None,
                     *, idempotency_key: str | None = None, wait: float | None = None,
                     **fields: Any) -> dict[str, Any]:
        """POST /v1/jobs; returns ``{"job_id", "status", "status_url"}``.

        Always sent with an ``Idempotency-Key`` (a new UUID unless given), the same on every
        retry: a submit whose answer was lost and that is sent again is still one job.

        ``wait``: the seconds the caller will wait for the answer (``Prefer: wait=N``, N
        rounded up; the API holds it at most its api_prefer_wait_max_seconds). A job final
        within them returns its whole view (``status`` completed, dead_letter or cancelled)
        with ``result``, the artifact's JSON; otherwise the usual accepted answer, after
        the wait. A retry after a lost answer waits the same way for the same job."""
        body = {"workflow": workflow, **fields}
        if input is not None:
            body["input"] = input
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        kw: dict[str, Any] = {}
        if wait is not None and wait > 0:
            seconds = math.ceil(wait)
            headers["Prefer"] = f"wait={seconds}"
            # The answer may take the wait itself: the read timeout must not end it first.
            timeout = self._session.timeout.sock_read or 30.0
            kw["timeout"] = aiohttp.ClientTimeout(total=None, sock_read=seconds + timeout)
        result: dict[str, Any] = await self._call("POST", "/v1/jobs", json=body,
                                                  expect=(200, 202), headers=headers, **kw)
        return result

    async def submit_file(self, workflow: str, path: Path, *, content_type: str =
                          "application/octet-stream", idempotency_key: str | None = None,
                          **fields: Any) -> dict[str, Any]:
        """Multipart submit; the file is streamed from disk, never read whole (and opened
        again for a retry, with the same idempotency key)."""
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}

        async def once() -> dict[str, Any]:
            with path.open("rb") as fh:
                form = aiohttp.FormData()
                form.add_field("workflow", workflow)
                for name, value in fields.items():
                    form.add_field(name, value if isinstance(value, str) else json.dumps(value))
                form.add_field("file", fh, filename=path.name, content_type=content_type)
                answer: dict[str, Any] = await self._call(
                    "POST", "/v1/jobs", data=form, expect=202, headers=headers, retry=False)
                return answer

        async def guarded() -> dict[str, Any]:
            try:
                return await once()
            except _CONNECTION_ERRORS as exc:
                raise _Retry(exc) from exc
            except ApiError as exc:
                if exc.status in self.retry.statuses:
                    raise _Retry(exc, exc.retry_after or 0.0) from exc
                raise

        return await self._retrying(guarded)

    async def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", f"/v1/jobs/{job_id}")
        return result

    async def list_jobs(self, **filters: str | int) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "GET", "/v1/jobs", params={k: str(v) for k, v in filters.items()})
        return result

    async def cancel(self, job_id: str) -> dict[str, Any]:
        # Not retried: a cancel whose answer was lost would come back as a conflict.
        result: dict[str, Any] = await self._call("POST", f"/v1/jobs/{job_id}/cancel",
                                                  retry=False)
        return result

    async def delete(self, job_id: str) -> None:
        await self._call("DELETE", f"/v1/jobs/{job_id}", expect=204, retry=False)

    async def artifact(self, job_id: str) -> AsyncIterator[bytes]:
        """The artifact's bytes, chunk by chunk."""
        async with self._session.get(f"{self.base_url}/v1/jobs/{job_id}/artifact",
                                     headers=self._headers) as resp:
            if resp.status != 200:
                raise _error(resp.status, await resp.read())
            async for chunk in resp.content.iter_chunked(64 * 1024):
                yield chunk

    async def events(self, job_id: str, *, after: int | str = 0
                     ) -> AsyncIterator[dict[str, Any]]:
        """The job's events as the SSE stream sends them, until the job is terminal: each a
        dict with ``id`` and ``type`` (and the event's data).

        History events (``queued``, ``running``, ``completed``, ...) and, for a streamed
        step, ``output.delta`` (``text``, ``step``, ``attempt``, ``seq``, ``offset``: the
        step's text is the deltas' concatenation) and ``reset`` (a new attempt of ``step``
        starts over: drop what that step's deltas gave so far).

        A stream cut by the network or an API restart is opened again with ``Last-Event-ID``
        (the id of the last event yielded), so no event is missed and none is repeated; the
        retry policy's count starts over whenever an event arrives. ``after``: an event id
        to start after."""
        last = str(after)
        started = time.monotonic()
        failures = 0
        while True:
            try:
                async for event in self._event_stream(job_id, last):
                    if event.get("id") is not None:
                        last = str(event["id"])
                    failures, started = 0, time.monotonic()
                    yield event
                return
            except _Retry as retry:
                failures += 1
                pause = max(self.retry.backoff.delay(failures), retry.wait)
                if (failures >= self.retry.attempts
                        or time.monotonic() - started + pause > self.retry.max_elapsed):
                    raise retry.cause from None
                await asyncio.sleep(pause)

    async def _event_stream(self, job_id: str, after: str) -> AsyncIterator[dict[str, Any]]:
        headers = {**self._headers, "Accept": "text/event-stream"}
        if after and after != "0":
            headers["Last-Event-ID"] = after
        try:
            async with self._session.get(f"{self.base_url}/v1/jobs/{job_id}/events",
                                         headers=headers) as resp:
                if resp.status != 200:
                    error = _error(resp.status, await resp.read())
                    if resp.status in self.retry.statuses:
                        raise _Retry(error, _retry_after(resp.headers.get("Retry-After")) or 0)
                    raise error
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
                        data = json.loads(fields["data"])
                        yield {"id": fields.get("id"),
                               "type": data.get("type", fields.get("event")), **data}
                    fields = {}
        except _CONNECTION_ERRORS as exc:
            raise _Retry(exc) from exc
        # The server closed the stream without its "end" event: an API going away.
        raise _Retry(ConnectionError("the event stream ended before the job finished"))


def _error(status: int, text: bytes) -> ApiError:
    try:
        body = json.loads(text)
        return ApiError(str(body.get("detail")), code=str(body.get("code")), status=status)
    except (ValueError, AttributeError):
        return ApiError(text.decode("utf-8", "replace")[:500], code="http_error", status=status)
