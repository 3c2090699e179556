"""The providers' batch APIs, in the style of calmq.calls.wires: OpenAI's Batch API (a JSONL
file of requests, ``POST /v1/batches``, output and error files) and Anthropic's Message
Batches (``POST /v1/messages/batches``, a JSONL ``results_url``).

A batch request's body is built by the online provider's own ``request_body`` and a
result's reply read by its own ``parse_reply``, and a failed request is classified by
``classify_status``: a batched step sees exactly the answer, and meets exactly the failure
class, the online call would have given it. Results are streamed (never a whole file in
memory): a 200 MB results file is normal.

A results file is untrusted input: each line is read on its own, and a line that is not
the provider's result shape fails only the request it names (``batch_result_unreadable``;
a line naming no request is skipped, and its request ends ``batch_result_missing``). A line
longer than ``max_line`` bytes is skipped unread (``batch_result_too_large``); lines are
split in one pass over each chunk, so a 50 MB line costs its bytes once, not once per
chunk. A refused call (4xx) raises ``BatchRefused`` with the failure the online call would
have met, so the poller can block a provider whose key was refused instead of retrying.
Once a batch is collected its files are deleted at the provider (``delete``).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp

from calmq.calls.wires import (
    AnthropicProvider,
    Endpoint,
    ModelReply,
    OpenAIProvider,
    classify_status,
)
from calmq.errors import InfrastructureError, StepFailure
from calmq.failure_codes import failure

__all__ = ["AnthropicBatches", "BatchClient", "BatchRefused", "BatchResult", "BatchView",
           "LineError", "OpenAIBatches", "custom_id", "open_batch_client", "parse_custom_id"]

# Provider limits per batch (requests, bytes of requests).
OPENAI_LIMITS = (50_000, 200 * 1024 * 1024)
ANTHROPIC_LIMITS = (100_000, 256 * 1024 * 1024)
# Anthropic's custom_id allows [A-Za-z0-9_-]{1,64}: a job id (36) + "_" + the attempt.
_SEPARATOR = "_"
_CHUNK = 1 << 16
# The longest results line read by default (settings.batch_max_result_line_bytes).
MAX_LINE = 16 * 1024 * 1024
# How much of an unreadable or too long line is searched for the custom_id it names.
_HEAD = 4096
_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*"([A-Za-z0-9_-]{1,64})"')


def custom_id(job_id: object, attempt: int) -> str:
    return f"{job_id}{_SEPARATOR}{attempt}"


def parse_custom_id(value: str) -> tuple[str, int]:
    job_id, _, attempt = value.rpartition(_SEPARATOR)
    return job_id, int(attempt)


class BatchRefused(InfrastructureError):
    """The provider refused a batch call (a 4xx but 429): ``failure`` is what the online
    call would have met (a refused key blocks the provider; a refused request is its job's
    input). ``missing``: a 404, the batch or file is not there (never "model not found": a
    batch call names no model in its path)."""

    def __init__(self, message: str, failure: StepFailure, *, missing: bool = False) -> None:
        super().__init__(message)
        self.failure = failure
        self.missing = missing


@dataclass(frozen=True)
class LineError:
    """One error of a batch the provider failed as a whole: the input line (1-based) or
    request index (0-based) it names, if any."""

    message: str
    code: str | None = None
    line: int | None = None


@dataclass(frozen=True)
class BatchView:
    """What the provider says of a batch, in calmq's words: ``outcome`` is completed,
    expired, cancelled or failed (the provider refused the batch as a whole: ``errors``)
    once it ended (None while it runs)."""

    provider_id: str
    status: str  # the provider's own status word
    outcome: str | None
    counts: dict[str, int] = field(default_factory=dict)
    results: tuple[str, ...] = ()  # where its results are (file ids or a URL)
    input_file: str | None = None  # OpenAI: the uploaded input file
    errors: tuple[LineError, ...] = ()

    @property
    def ended(self) -> bool:
        return self.outcome is not None


@dataclass(frozen=True)
class _TooLong:
    """A results line longer than the cap: skipped unread but for its first bytes."""

    head: bytes


@dataclass(frozen=True)
class BatchResult:
    """One request's result: a reply the step reads, or the failure the call would raise."""

    custom_id: str
    reply: ModelReply | None = None
    failure: StepFailure | None = None


def _not_run(code: str) -> StepFailure:
    return failure(code, f"the provider did not run this request: {code}")


def _named(head: bytes) -> str:
    """The custom_id a (possibly broken) results line names in its first bytes, or ""."""
    found = _CUSTOM_ID.search(head[:_HEAD])
    return found.group(1).decode() if found else ""


def refusal(method: str, path: str, status: int, text: str) -> InfrastructureError:
    """A provider's non-2xx answer to a batch call: BatchRefused for a 4xx but 429 (what the
    online call would have met), else InfrastructureError (tried again later)."""
    message = f"{method} {path}: the provider answered {status}: {text[:300]}"
    if status == 404:
        return BatchRefused(message, failure("provider_bad_request", message), missing=True)
    if 400 <= status < 500 and status != 429:
        return BatchRefused(message, classify_status(status, text, None))
    if status == 429 and "insufficient_quota" in text:
        return BatchRefused(message, classify_status(status, text, None))
    return InfrastructureError(message)


class BatchClient:
    """One provider's batch API for one model (the base: sessions, errors, line streaming)."""

    kind = "openai"
    limits = OPENAI_LIMITS

    def __init__(self, base_url: str, api_key: str, model: str, *,
                 endpoint: Endpoint | None = None, max_line: int = MAX_LINE) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.api = endpoint or Endpoint(self.kind, base_url, api_key)
        self.max_line = max_line
        self._session: aiohttp.ClientSession | None = None

    @property
    def endpoint(self) -> str:
        raise NotImplementedError

    def headers(self) -> dict[str, str]:
        return self.api.headers()

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _json(self, method: str, path: str, *, missing_ok: bool = False,
                    **kw: Any) -> Any:
        """The JSON answer of one call; with ``missing_ok`` a 404 is None (a delete of what
        is gone already)."""
        url = path if path.startswith("http") else self.api.url(path)
        try:
            async with self.session().request(method, url, headers=self.headers(),
                                              **kw) as resp:
                text = await resp.text()
                if missing_ok and resp.status == 404:
                    return None
                if resp.status >= 300:
                    raise refusal(method, path, resp.status, text)
                return json.loads(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise InfrastructureError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    async def _lines(self, url: str) -> AsyncIterator[bytes | _TooLong]:
        """The lines of a JSONL download, read in 64 KiB chunks: memory is one line (at most
        ``max_line``) and a chunk. Each chunk is scanned once for its newlines, so a line of
        any length costs its bytes once; a line over ``max_line`` is skipped, unread but for
        its first bytes (``_TooLong``)."""
        full = url if url.startswith("http") else self.api.url(url)
        try:
            async with self.session().get(full, headers=self.headers()) as resp:
                if resp.status >= 300:
                    raise refusal("GET", url, resp.status, (await resp.text())[:300])
                line = bytearray()
                skipping: bytes | None = None  # the head of a too long line being skipped
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    start = 0
                    while start <= len(chunk):
                        end = chunk.find(b"\n", start)
                        piece = chunk[start:] if end < 0 else chunk[start:end]
                        if skipping is None and len(line) + len(piece) > self.max_line:
                            skipping = bytes(line[:_HEAD]) + piece[:max(0, _HEAD - len(line))]
                            line.clear()
                        if skipping is None:
                            line += piece
                        if end < 0:
                            break
                        if skipping is not None:
                            yield _TooLong(skipping)
                            skipping = None
                        elif line.strip():
                            yield bytes(line)
                        line.clear()
                        start = end + 1
                if skipping is not None:
                    yield _TooLong(skipping)
                elif line.strip():
                    yield bytes(line)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise InfrastructureError(f"GET {url}: {type(exc).__name__}: {exc}") from exc

    async def results(self, view: BatchView) -> AsyncIterator[BatchResult]:
        """Each request's result, one line at a time; a line that cannot be read fails only
        the request it names (none named: skipped, ``custom_id`` "")."""
        for source in view.results:
            async for line in self._lines(self._download(source)):
                yield self.read_line(line)

    def _download(self, result: str) -> str:
        """Where a batch's results (``view.results``: a file id or a URL) are read from."""
        return result

    def read_line(self, line: bytes | _TooLong) -> BatchResult:
        if isinstance(line, _TooLong):
            return BatchResult(_named(line.head), failure=failure(
                "batch_result_too_large", f"the provider's result for this request is longer "
                f"than {self.max_line} bytes (batch_max_result_line_bytes); not read"))
        try:
            return self._result(line)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            return BatchResult(_named(line), failure=failure(
                "batch_result_unreadable", f"the provider's result line for this request is "
                f"not a result: {type(exc).__name__}: {str(exc)[:200]}"))

    def _result(self, line: bytes) -> BatchResult:
        raise NotImplementedError

    async def probe(self) -> object:
        """One tiny online call with this client's key and model (a blocked provider's probe:
        calmq.calls.gate)."""
        raise NotImplementedError

    async def delete(self, view: BatchView) -> None:
        """Delete what the provider keeps of an ended batch: its input and result files
        (OpenAI), the batch and its results (Anthropic). What is gone already is no error."""
        raise NotImplementedError

    async def input_custom_ids(self, view: BatchView, lines: set[int]) -> dict[int, str]:
        """The custom_id of each of these (1-based) lines of the batch's input file."""
        return {}

    # The interface the batcher and the poller use.

    def request_body(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                     response_schema: dict[str, Any] | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def line(self, custom_id: str, body: dict[str, Any]) -> bytes:
        """One request as the batch carries it (its size counts against the byte limit)."""
        raise NotImplementedError

    async def create(self, lines: list[bytes], key: str) -> BatchView:
        raise NotImplementedError

    async def find(self, key: str, since: datetime, count: int,
                   known: set[str]) -> str | None:
        """The provider's id of a batch created with ``key`` that calmq did not record."""
        raise NotImplementedError

    async def view(self, provider_id: str) -> BatchView:
        raise NotImplementedError

    async def cancel(self, provider_id: str) -> None:
        raise NotImplementedError


class OpenAIBatches(BatchClient):
    """OpenAI's Batch API: upload the JSONL (purpose ``batch``), create the batch with a
    ``24h`` completion window and calmq's key in its ``metadata``, read the output file and
    the error file."""

    kind = "openai"
    limits = OPENAI_LIMITS
    # "failed": the input file failed validation, no request ran (not "expired": its jobs
    # are not all to blame; the errors name the lines).
    _STATUS = {"completed": "completed", "expired": "expired", "cancelled": "cancelled",
               "failed": "failed"}

    def __init__(self, base_url: str, api_key: str, model: str, *,
                 endpoint: Endpoint | None = None,
                 structured: dict[str, str] | None = None, max_line: int = MAX_LINE) -> None:
        super().__init__(base_url, api_key, model, endpoint=endpoint, max_line=max_line)
        self._online = OpenAIProvider(base_url, api_key, model, endpoint=self.api,
                                      structured=structured)

    @property
    def endpoint(self) -> str:
        return self._online.endpoint

    def request_body(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                     response_schema: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._online.request_body(messages=messages, job_id=job_id,
                                         max_tokens=max_tokens, response_schema=response_schema)

    def line(self, custom_id: str, body: dict[str, Any]) -> bytes:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": self.endpoint,
                           "body": body}, separators=(",", ":")).encode() + b"\n"

    async def create(self, lines: list[bytes], key: str) -> BatchView:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", b"".join(lines), filename=f"calmq-{key}.jsonl",
                       content_type="application/jsonl")
        uploaded = await self._json("POST", "/files", data=form)
        try:
            created = await self._json("POST", "/batches", json={
                "input_file_id": uploaded["id"], "endpoint": self.endpoint,
                "completion_window": "24h", "metadata": {"calmq_key": key}})
        except BatchRefused:
            # No batch holds the uploaded file: it must not stay with the provider.
            await self._delete_file(str(uploaded["id"]))
            raise
        return self._view(created)

    async def find(self, key: str, since: datetime, count: int,
                   known: set[str]) -> str | None:
        after: str | None = None
        floor = since.timestamp() - 300  # clocks differ
        while True:
            page = await self._json("GET", "/batches",
                                    params={"limit": "100", **({"after": after} if after else {})})
            for item in page.get("data", []):
                if (item.get("metadata") or {}).get("calmq_key") == key:
                    return str(item["id"])
                if int(item.get("created_at") or 0) < floor:
                    return None
            if not page.get("has_more") or not page.get("last_id"):
                return None
            after = str(page["last_id"])

    async def view(self, provider_id: str) -> BatchView:
        return self._view(await self._json("GET", f"/batches/{provider_id}"))

    def _view(self, data: dict[str, Any]) -> BatchView:
        status = str(data.get("status"))
        counts = {k: int(v) for k, v in (data.get("request_counts") or {}).items()}
        files = tuple(str(f) for f in (data.get("output_file_id"), data.get("error_file_id"))
                      if f)
        errors = tuple(
            LineError(str(e.get("message") or ""), e.get("code"),
                      int(e["line"]) if isinstance(e.get("line"), int) else None)
            for e in ((data.get("errors") or {}).get("data") or []) if isinstance(e, dict))
        return BatchView(str(data["id"]), status, self._STATUS.get(status), counts, files,
                         str(data["input_file_id"]) if data.get("input_file_id") else None,
                         errors)

    async def probe(self) -> object:
        return await self._online.complete(messages=[{"role": "user", "content": "ping"}],
                                           job_id="calmq-probe", max_tokens=1)

    async def _delete_file(self, file_id: str) -> None:
        await self._json("DELETE", f"/files/{file_id}", missing_ok=True)

    async def delete(self, view: BatchView) -> None:
        for file_id in (view.input_file, *view.results):
            if file_id:
                await self._delete_file(file_id)

    def _download(self, result: str) -> str:
        return f"/files/{result}/content"

    async def input_custom_ids(self, view: BatchView, lines: set[int]) -> dict[int, str]:
        found: dict[int, str] = {}
        if not view.input_file or not lines:
            return found
        number = 0
        async for line in self._lines(f"/files/{view.input_file}/content"):
            number += 1  # blank lines are not yielded: calmq's input files have none
            if number in lines:
                found[number] = _named(line.head if isinstance(line, _TooLong) else line)
            if number >= max(lines):
                break
        return found

    def _result(self, line: bytes) -> BatchResult:
        item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str):
            raise TypeError("no custom_id")
        cid = str(item.get("custom_id"))
        response = item.get("response")
        error = item.get("error")
        if response is None:
            code = str((error or {}).get("code") or "batch_request_failed")
            if code in ("batch_expired", "batch_cancelled"):
                return BatchResult(cid, failure=_not_run(code))
            return BatchResult(cid, failure=classify_status(400, json.dumps(error), None))
        status = int(response.get("status_code") or 500)
        body = response.get("body")
        if status >= 300:
            return BatchResult(cid, failure=classify_status(status, json.dumps(body), None))
        try:
            return BatchResult(cid, reply=self._online.parse_reply(body))
        except StepFailure as failure:
            return BatchResult(cid, failure=failure)

    async def cancel(self, provider_id: str) -> None:
        await self._json("POST", f"/batches/{provider_id}/cancel")


# Anthropic's error types and the HTTP status each stands for (to classify like online).
_ANTHROPIC_STATUS = {"invalid_request_error": 400, "authentication_error": 401,
                     "permission_error": 403, "not_found_error": 404,
                     "request_too_large": 413, "rate_limit_error": 429, "api_error": 500,
                     "overloaded_error": 529}


class AnthropicBatches(BatchClient):
    """Anthropic's Message Batches: the requests in the create call, results from
    ``results_url``. Its batches carry no metadata: a batch created but not recorded is
    found again as the one unrecorded batch of the same size created since (``find``)."""

    kind = "anthropic"
    limits = ANTHROPIC_LIMITS

    def __init__(self, base_url: str, api_key: str, model: str, *,
                 endpoint: Endpoint | None = None,
                 structured: dict[str, str] | None = None, max_line: int = MAX_LINE) -> None:
        super().__init__(base_url, api_key, model, endpoint=endpoint, max_line=max_line)
        self._online = AnthropicProvider(base_url, api_key, model, endpoint=self.api,
                                         structured=structured)

    @property
    def endpoint(self) -> str:
        return self._online.endpoint

    def request_body(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                     response_schema: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._online.request_body(messages=messages, job_id=job_id,
                                         max_tokens=max_tokens, response_schema=response_schema)

    def line(self, custom_id: str, body: dict[str, Any]) -> bytes:
        return json.dumps({"custom_id": custom_id, "params": body},
                          separators=(",", ":")).encode()

    async def create(self, lines: list[bytes], key: str) -> BatchView:
        body = b'{"requests":[' + b",".join(lines) + b"]}"
        return self._view(await self._post_raw(body))

    async def _post_raw(self, body: bytes) -> Any:
        headers = {**self.headers(), "content-type": "application/json"}
        url = self.api.url("/messages/batches")
        try:
            async with self.session().post(url, data=body, headers=headers) as resp:
                text = await resp.text()
                if resp.status >= 300:
                    raise refusal("POST", "/v1/messages/batches", resp.status, text)
                return json.loads(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise InfrastructureError(f"POST /v1/messages/batches: {exc}") from exc

    async def find(self, key: str, since: datetime, count: int,
                   known: set[str]) -> str | None:
        page = await self._json("GET", "/messages/batches", params={"limit": "100"})
        floor = since.timestamp() - 5
        found = []
        for item in page.get("data", []):
            created = datetime.fromisoformat(str(item["created_at"]).replace("Z", "+00:00"))
            total = sum(int(v) for v in (item.get("request_counts") or {}).values())
            if (str(item["id"]) not in known and created.timestamp() >= floor
                    and total == count):
                found.append(str(item["id"]))
        return found[-1] if found else None  # the oldest such: the first one made

    async def view(self, provider_id: str) -> BatchView:
        return self._view(await self._json("GET", f"/messages/batches/{provider_id}"))

    def _view(self, data: dict[str, Any]) -> BatchView:
        status = str(data.get("processing_status"))
        counts = {k: int(v) for k, v in (data.get("request_counts") or {}).items()}
        outcome = None
        if status == "ended":
            outcome = ("cancelled" if data.get("cancel_initiated_at") else
                       "expired" if counts.get("expired") else "completed")
        url = data.get("results_url")
        return BatchView(str(data["id"]), status, outcome, counts, (str(url),) if url else ())

    async def probe(self) -> object:
        return await self._online.complete(messages=[{"role": "user", "content": "ping"}],
                                           job_id="calmq-probe", max_tokens=1)

    async def delete(self, view: BatchView) -> None:
        # The batch and its results go together; only an ended batch can be deleted.
        await self._json("DELETE", f"/messages/batches/{view.provider_id}", missing_ok=True)

    def _result(self, line: bytes) -> BatchResult:
        item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str):
            raise TypeError("no custom_id")
        cid = str(item.get("custom_id"))
        result = item.get("result") or {}
        kind = result.get("type")
        if kind == "succeeded":
            try:
                return BatchResult(cid, reply=self._online.parse_reply(result.get("message")))
            except StepFailure as failure:
                return BatchResult(cid, failure=failure)
        if kind == "errored":
            error = result.get("error") or {}
            nested = error.get("error")
            inner: dict[str, Any] = nested if isinstance(nested, dict) else error
            status = _ANTHROPIC_STATUS.get(str(inner.get("type")), 500)
            return BatchResult(cid, failure=classify_status(status, json.dumps(error), None))
        return BatchResult(cid, failure=_not_run(
            "batch_expired" if kind == "expired" else "batch_cancelled"))

    async def cancel(self, provider_id: str) -> None:
        await self._json("POST", f"/messages/batches/{provider_id}/cancel")


def open_batch_client(kind: str, base_url: str, api_key: str, model: str, *,
                      extra_headers: dict[str, str] | None = None, api_version: str = "",
                      structured: dict[str, str] | None = None,
                      max_line: int = MAX_LINE) -> BatchClient:
    endpoint = Endpoint(kind, base_url, api_key, tuple((extra_headers or {}).items()),
                        api_version)
    if kind == "anthropic":
        return AnthropicBatches(base_url, api_key, model, endpoint=endpoint,
                                structured=structured, max_line=max_line)
    return OpenAIBatches(base_url, api_key, model, endpoint=endpoint, structured=structured,
                         max_line=max_line)

