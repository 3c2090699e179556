"""The API's calls as data, and what an answer means: the part of the client that does no I/O,
shared by ``Client`` and ``AsyncClient`` so that the two cannot drift apart."""

from __future__ import annotations

import contextlib
import json
import math
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx2

from calmq_client._errors import ApiError, ClientError, ConnectionFailed, OutcomeUnknown
from calmq_client._retrying import NOT_ACTED_ON, RetryPolicy, retry_after

__all__ = ["BULK_MAX", "Call", "Upload", "answer_failure", "bulk_chunks", "bulk_results",
           "check_digest", "decode", "events", "job_path", "list_jobs", "problem",
           "stream_broke", "submit", "submit_file", "transport_failure"]

# The transport failed before the request left: the API cannot have acted on it.
_NOT_SENT = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)
# This side refused to send the request (a header it cannot hold, a scheme it does not
# speak): it will refuse again.
_REFUSED_HERE = (httpx2.LocalProtocolError, httpx2.UnsupportedProtocol)


@dataclass(frozen=True, slots=True)
class Upload:
    """A file sent as the multipart ``file`` part, opened again for each try."""

    path: Path
    content_type: str
    fields: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Call:
    """One API call. ``safe``: repeating it cannot do harm (a read, a keyed submit), so any
    failure a retry may cure is retried; otherwise only a failure the API did not act on.
    ``wait``: seconds the API may hold the answer (``Prefer: wait``), added to the read
    timeout."""

    method: str
    path: str
    expect: tuple[int, ...] = (200,)
    safe: bool = True
    params: Mapping[str, str] | None = None
    body: Mapping[str, Any] | None = None
    upload: Upload | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    wait: float = 0.0

    @contextlib.contextmanager
    def content(self) -> Iterator[dict[str, Any]]:
        """The request's body as the HTTP library's keyword arguments, a file kept open for
        the duration of one try (streamed from disk, never read whole)."""
        if self.upload is None:
            yield {} if self.body is None else {"json": self.body}
            return
        upload = self.upload
        with upload.path.open("rb") as fh:
            yield {"data": dict(upload.fields),
                   "files": {"file": (upload.path.name, fh, upload.content_type)}}

    def timeout(self, seconds: float) -> httpx2.Timeout:
        return httpx2.Timeout(seconds, read=seconds + self.wait)


def job_path(job_id: str, tail: str = "") -> str:
    return f"/v1/jobs/{quote(str(job_id), safe='')}{tail}"


def submit(workflow: str, input: Mapping[str, Any] | None, *,
           idempotency_key: str | None, wait: float | None, fields: Mapping[str, Any]) -> Call:
    body: dict[str, Any] = {"workflow": workflow}
    if input is not None:
        body["input"] = dict(input)
    body.update({k: v for k, v in fields.items() if v is not None})
    headers, seconds = _submit_headers(idempotency_key, wait)
    return Call("POST", "/v1/jobs", expect=(200, 202), safe=idempotency_key is not None,
                body=body, headers=headers, wait=seconds)


def rerun(job_id: str, from_step: str, input: Mapping[str, Any] | None,
          priority: str | None, idempotency_key: str | None = None) -> Call:
    """POST /v1/jobs/{id}/rerun: a new job each time it is sent, so not safe to repeat,
    unless it carries an idempotency key (the same key answers the same new job)."""
    body: dict[str, Any] = {"from_step": from_step}
    if input is not None:
        body["input"] = dict(input)
    if priority is not None:
        body["priority"] = priority
    headers = {} if idempotency_key is None else {"Idempotency-Key": idempotency_key}
    return Call("POST", job_path(job_id, "/rerun"), expect=(202,),
                safe=idempotency_key is not None, body=body, headers=headers)


def submit_file(workflow: str, path: Path, *, content_type: str, idempotency_key: str | None,
                fields: Mapping[str, Any]) -> Call:
    form = {"workflow": workflow}
    form.update({k: v if isinstance(v, str) else json.dumps(v)
                 for k, v in fields.items() if v is not None})
    headers, _ = _submit_headers(idempotency_key, None)
    return Call("POST", "/v1/jobs", expect=(202,), safe=idempotency_key is not None,
                upload=Upload(Path(path), content_type, form), headers=headers)


BULK_MAX = 1000  # the API's default api_bulk_max_jobs


def bulk_chunks(items: Iterable[Mapping[str, Any]], size: int, *, keys: bool
                ) -> Iterator[tuple[int, Call]]:
    """POST /v1/jobs/bulk calls of at most ``size`` items each, with each chunk's first
    index. ``keys``: an item without an ``idempotency_key`` gets one, made of a random id of
    this run and its index, and keeps it on every try, so a chunk whose answer was lost is
    sent again without writing any job twice (a chunk whose every item has a key is safe to
    repeat; otherwise it is retried only when the API certainly did not take it)."""
    if not 1 <= size <= BULK_MAX:
        raise ValueError(f"chunk_size is 1 to {BULK_MAX}")
    run = uuid.uuid4().hex if keys else None
    chunk: list[dict[str, Any]] = []
    start = 0
    for index, item in enumerate(items):
        body = {k: v for k, v in item.items() if v is not None}
        if run is not None and "idempotency_key" not in body:
            body["idempotency_key"] = f"{run}-{index}"
        chunk.append(body)
        if len(chunk) == size:
            yield start, _bulk(chunk)
            start, chunk = start + size, []
    if chunk:
        yield start, _bulk(chunk)


def _bulk(chunk: list[dict[str, Any]]) -> Call:
    return Call("POST", "/v1/jobs/bulk", safe=all("idempotency_key" in j for j in chunk),
                body={"jobs": chunk})


def bulk_results(start: int, answer: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chunk's results with ``index`` counted over the whole ``submit_many`` call."""
    return [{**r, "index": start + int(r["index"])} for r in answer["results"]]


def _submit_headers(key: str | None, wait: float | None) -> tuple[dict[str, str], float]:
    # No key unless asked for: keyed submits are each their own transaction on the server,
    # while unkeyed ones share group commits.
    headers = {} if key is None else {"Idempotency-Key": key}
    if wait is None or wait <= 0:
        return headers, 0.0
    seconds = math.ceil(wait)  # the header takes whole seconds
    headers["Prefer"] = f"wait={seconds}"
    return headers, float(seconds)


def list_jobs(*, status: str | Iterable[str] | None, workflow: str | None,
              created_after: datetime | str | None, created_before: datetime | str | None,
              limit: int | None, cursor: str | None,
              metadata: Mapping[str, str] | None = None) -> Call:
    params: dict[str, str] = {f"metadata.{k}": str(v) for k, v in (metadata or {}).items()}
    if status is not None:
        params["status"] = status if isinstance(status, str) else ",".join(status)
    for name, value in (("created_after", created_after), ("created_before", created_before)):
        if value is not None:
            params[name] = value.isoformat() if isinstance(value, datetime) else value
    if workflow is not None:
        params["workflow"] = workflow
    if limit is not None:
        params["limit"] = str(limit)
    if cursor is not None:
        params["cursor"] = cursor
    return Call("GET", "/v1/jobs", params=params)


def events(job_id: str, last_event_id: str | None) -> Call:
    headers = {"Accept": "text/event-stream"}
    if last_event_id and last_event_id != "0":
        headers["Last-Event-ID"] = last_event_id
    return Call("GET", job_path(job_id, "/events"), headers=headers)


def decode(body: bytes) -> Any:
    return json.loads(body) if body else None


def problem(status: int, body: bytes, headers: httpx2.Headers) -> ApiError:
    """The API's problem+json answer as an ApiError (a proxy's HTML page as ``http_error``)."""
    wait = retry_after(headers.get("Retry-After"))
    try:
        found = json.loads(body)
        if not isinstance(found, dict):
            raise TypeError(type(found).__name__)
    except (ValueError, TypeError):
        text = body.decode("utf-8", "replace")[:500]
        return ApiError(status, "http_error", text, retry_after=wait)
    return ApiError(status, str(found.get("code") or "http_error"), str(found.get("detail")),
                    title=found.get("title"), type=found.get("type"), retry_after=wait)


def answer_failure(call: Call, policy: RetryPolicy, status: int, headers: httpx2.Headers,
                   body: bytes) -> tuple[ClientError, float | None]:
    """An unexpected answer: the error, and the least pause before a retry (None: final)."""
    error = problem(status, body, headers)
    if status in policy.statuses and (call.safe or status in NOT_ACTED_ON):
        return error, error.retry_after or 0.0
    return error, None


def transport_failure(call: Call, exc: httpx2.TransportError
                      ) -> tuple[ClientError, float | None]:
    """A failed exchange: the error (the transport's as its cause), and whether to retry."""
    if isinstance(exc, _REFUSED_HERE):
        error: ClientError = ConnectionFailed(f"{call.method} {call.path} not sent: {exc!r}")
        error.__cause__ = exc
        return error, None
    if call.safe or isinstance(exc, _NOT_SENT):
        error = ConnectionFailed(f"{call.method} {call.path}: {exc!r}")
        error.__cause__ = exc
        return error, 0.0
    error = OutcomeUnknown(
        f"{call.method} {call.path} was sent and its answer lost ({exc!r}); it may have "
        "taken effect. A submit with an idempotency key is retried instead.")
    error.__cause__ = exc
    return error, None


def stream_broke(exc: BaseException | None) -> ConnectionFailed:
    if exc is None:
        # The server closed the stream without its "end" event: an API going away.
        return ConnectionFailed("the event stream ended before the job finished")
    error = ConnectionFailed(f"the connection broke: {exc!r}")
    error.__cause__ = exc
    return error


def check_digest(headers: httpx2.Headers, sha256: str) -> None:
    """The API sends the artifact's SHA-256 as its ETag: bytes that differ are not it."""
    sent = headers.get("ETag", "").strip('"')
    if sent and sent != sha256:
        raise ClientError(f"the artifact's bytes hash to {sha256}, not the {sent} the API "
                          "sent: the download is not the artifact")
