"""``AsyncClient``: the API from asyncio code. ``Client`` (calmq_client._client) is the same
API, call for call, for code without an event loop."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx2

from calmq_client import _calls as calls
from calmq_client._calls import Call, answer_failure, decode, job_path, transport_failure
from calmq_client._errors import ClientError
from calmq_client._events import Delta, EventDecoder, delta
from calmq_client._retrying import Attempts, RetryPolicy
from calmq_client._version import USER_AGENT

__all__ = ["AsyncClient"]

_CHUNK = 64 * 1024


class AsyncClient:
    """The calmq API from asyncio code: ``async with AsyncClient(url, key) as api:``.

    ``timeout``: seconds to connect and between bytes read (an event stream's keep-alives
    come every 15 s). ``retry``: how failures a retry may cure are retried
    (calmq_client.RetryPolicy). ``http``: an httpx2.AsyncClient of your own (proxies,
    certificates, transports); it is not closed here."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0,
                 retry: RetryPolicy | None = None,
                 http: httpx2.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}", "User-Agent": USER_AGENT}
        self._own = http is None
        self._http = http or httpx2.AsyncClient()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: type[BaseException] | BaseException | TracebackType | None
                        ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own:
            await self._http.aclose()

    # -- the calls ----------------------------------------------------------------------------

    async def submit(self, workflow: str, input: Mapping[str, Any] | None = None,
                     *, input_ref: str | None = None, priority: str | None = None,
                     deadline_seconds: int | None = None, callback_url: str | None = None,
                     metadata: Mapping[str, Any] | None = None,
                     idempotency_key: str | None = None, wait: float | None = None,
                     **fields: Any) -> dict[str, Any]:
        """POST /v1/jobs; returns ``{"job_id", "status": "queued", "status_url"}``.

        ``wait``: seconds to wait for the answer in the same request (``Prefer: wait``,
        rounded up; the API holds it at most its api_prefer_wait_max_seconds): a job final
        by then returns its whole view, with ``result`` (the artifact's JSON).
        ``idempotency_key``: the same key answers the same job, so a submit whose answer
        was lost is retried safely; without one the submit is retried only when the API
        certainly did not take it (OutcomeUnknown otherwise). Other ``fields`` (``lane``,
        ``concurrency_key``, ...) are sent as they are."""
        call = calls.submit(workflow, input, idempotency_key=idempotency_key, wait=wait,
                            fields={"input_ref": input_ref, "priority": priority,
                                    "deadline_seconds": deadline_seconds,
                                    "callback_url": callback_url, "metadata": metadata,
                                    **fields})
        answer: dict[str, Any] = await self._json(call)
        return answer

    async def submit_file(self, workflow: str, path: str | Path, *,
                          content_type: str = "application/octet-stream",
                          idempotency_key: str | None = None, **fields: Any) -> dict[str, Any]:
        """Multipart submit of a file, streamed from disk (and opened again for a retry)."""
        call = calls.submit_file(workflow, Path(path), content_type=content_type,
                                 idempotency_key=idempotency_key, fields=fields)
        answer: dict[str, Any] = await self._json(call)
        return answer

    async def submit_many(self, items: Iterable[Mapping[str, Any]], *,
                          chunk_size: int = 1000, idempotent: bool = True
                          ) -> list[dict[str, Any]]:
        """Many jobs through POST /v1/jobs/bulk, ``chunk_size`` (at most 1,000) a request,
        each chunk written by the API in one transaction; returns one result per item, in
        order: ``{"index", "status": "accepted"|"duplicate"|"refused", "job_id",
        "status_url"}`` or, refused, ``{"index", "status", "problem"}`` (a bad item never
        refuses the others). Each item is a POST /v1/jobs body (``workflow``, ``input``,
        ``metadata``, ...) with an optional ``idempotency_key``. ``idempotent`` (default):
        an item without a key gets one for this call, so a chunk whose answer was lost is
        sent again without writing a job twice; False sends no keys of its own (a chunk is
        then retried only when the API certainly did not take it)."""
        results: list[dict[str, Any]] = []
        for start, call in calls.bulk_chunks(items, chunk_size, keys=idempotent):
            results += calls.bulk_results(start, await self._json(call))
        return results

    async def get(self, job_id: str) -> dict[str, Any]:
        """GET /v1/jobs/{id}: the job's view (status, attempt, step, artifact, error,
        events)."""
        answer: dict[str, Any] = await self._json(Call("GET", job_path(job_id)))
        return answer

    async def list(self, *, status: str | Iterable[str] | None = None,
                   workflow: str | None = None, created_after: datetime | str | None = None,
                   created_before: datetime | str | None = None, limit: int | None = None,
                   cursor: str | None = None,
                   metadata: Mapping[str, str] | None = None) -> dict[str, Any]:
        """GET /v1/jobs: one page, newest first, ``{"jobs": [...], "next_cursor"}``; pass
        ``next_cursor`` back as ``cursor`` for the next page (None: the last one).
        ``metadata``: only jobs whose metadata holds each of these string values."""
        answer: dict[str, Any] = await self._json(calls.list_jobs(
            status=status, workflow=workflow, created_after=created_after,
            created_before=created_before, limit=limit, cursor=cursor,
            metadata=metadata))
        return answer

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """POST /v1/jobs/{id}/cancel. Not safe to repeat (a second cancel of a cancelled job
        is a conflict): retried only when the API certainly did not act on it."""
        answer: dict[str, Any] = await self._json(
            Call("POST", job_path(job_id, "/cancel"), safe=False))
        return answer

    async def rerun(self, job_id: str, from_step: str,
              input: Mapping[str, Any] | None = None, *,
              priority: str | None = None,
              idempotency_key: str | None = None) -> dict[str, Any]:
        """POST /v1/jobs/{id}/rerun: a new job that runs a job that ended again from
        ``from_step``, reusing the recorded outputs of the steps before it (no paid call of
        theirs again); ``input`` replaces what the step gets. Returns the 202 answer
        (``job_id``, ``rerun_of``, ...). Each call makes a new job: retried only when the
        API certainly did not act on it, unless ``idempotency_key`` is given: the same key
        with the same arguments answers the same new job, so a keyed rerun is retried like
        a keyed submit (another call under the key: 409 ``idempotency_key_reused``)."""
        answer: dict[str, Any] = await self._json(
            calls.rerun(job_id, from_step, input, priority, idempotency_key))
        return answer

    async def delete(self, job_id: str) -> None:
        """DELETE /v1/jobs/{id}: a final job's input, artifact and record are removed."""
        await self._json(Call("DELETE", job_path(job_id), expect=(204,), safe=False))

    async def artifact(self, job_id: str) -> AsyncIterator[bytes]:
        """The artifact's bytes, chunk by chunk."""
        response = await self._open(Call("GET", job_path(job_id, "/artifact")),
                                    Attempts(self.retry))
        try:
            async for chunk in response.aiter_bytes(_CHUNK):
                yield chunk
        finally:
            await response.aclose()

    async def download(self, job_id: str, path: str | Path) -> Path:
        """The artifact written to ``path`` (through ``path.part``, renamed when whole and
        its SHA-256 matches the one the API sent); a broken download starts over."""
        target = Path(path)
        part = target.with_name(target.name + ".part")
        attempts = Attempts(self.retry)
        call = Call("GET", job_path(job_id, "/artifact"))
        while True:
            response = await self._open(call, attempts)
            digest = hashlib.sha256()
            fh = await asyncio.to_thread(part.open, "wb")
            try:
                async for chunk in response.aiter_bytes(_CHUNK):
                    digest.update(chunk)
                    await asyncio.to_thread(fh.write, chunk)
            except httpx2.TransportError as exc:
                broke = calls.stream_broke(exc)
            else:
                await asyncio.to_thread(fh.close)
                calls.check_digest(response.headers, digest.hexdigest())
                await asyncio.to_thread(part.replace, target)
                return target
            finally:
                fh.close()
                await response.aclose()
            await asyncio.sleep(attempts.pause(broke, 0.0))

    async def events(self, job_id: str, *, after: int | str | None = None
                     ) -> AsyncIterator[dict[str, Any]]:
        """The job's events until it is final: each a dict with ``id`` and ``type`` and the
        event's data (history events, and a streamed step's ``output.delta`` and
        ``reset``). A stream cut by the network or an API restart is opened again with
        ``Last-Event-ID``: no event is missed or repeated. ``after``: an event id to start
        after (the ``id`` of the last event you have)."""
        last = None if after is None else str(after)
        attempts = Attempts(self.retry)
        while True:
            call = calls.events(job_id, last)
            response = await self._open(call, attempts)
            decoder = EventDecoder()
            broke: BaseException | None = None
            try:
                async for line in response.aiter_lines():
                    event = decoder.feed(line)
                    if decoder.ended:
                        return
                    if event is not None:
                        last = str(event["id"]) if event.get("id") is not None else last
                        attempts.reset()
                        yield event
            except httpx2.TransportError as exc:
                broke = exc
            finally:
                await response.aclose()
            await asyncio.sleep(attempts.pause(calls.stream_broke(broke), 0.0))

    async def output(self, job_id: str, *, step: str | None = None,
                     after: int | str | None = None) -> AsyncIterator[Delta]:
        """A streamed step's text as it is written (of ``step``, or of every step), until the
        job is final; resumed across a dropped connection like ``events``. A ``Delta`` with
        ``reset`` True says a new attempt starts that step's text over."""
        async for event in self.events(job_id, after=after):
            piece = delta(event, step)
            if piece is not None:
                yield piece

    # -- one call, tried per the policy ---------------------------------------------------------

    async def _json(self, call: Call) -> Any:
        response = await self._open(call, Attempts(self.retry), read=True)
        return decode(response.content)

    async def _open(self, call: Call, attempts: Attempts, *, read: bool = False
                    ) -> httpx2.Response:
        """The response to ``call`` with an expected status: its body read (``read``, the
        connection released), or to be read and closed by the caller."""
        while True:
            error: ClientError
            with call.content() as content:
                request = self._http.build_request(
                    call.method, self.base_url + call.path, params=call.params,
                    headers={**self._headers, **call.headers},
                    timeout=call.timeout(self.timeout), **content)
                try:
                    response = await self._http.send(request, stream=True)
                    if response.status_code in call.expect and not read:
                        return response
                    try:
                        await response.aread()
                    finally:
                        await response.aclose()
                except httpx2.TransportError as exc:
                    error, wait = transport_failure(call, exc)
                else:
                    if response.status_code in call.expect:
                        return response
                    error, wait = answer_failure(call, self.retry, response.status_code,
                                                 response.headers, response.content)
            if wait is None:
                raise error
            await asyncio.sleep(attempts.pause(error, wait))
