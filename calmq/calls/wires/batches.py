"""What the providers' batch APIs share (each provider's client is in its wire's module:
calmq.calls.wires.openai, calmq.calls.wires.anthropic): the client's base (``BatchClient``:
sessions, errors, results streamed line by line), what a batch and a result are in calmq's
words (``BatchView``, ``BatchResult``) and the requests' ``custom_id``.

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
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

import aiohttp

from calmq.calls.wires.base import ModelReply
from calmq.calls.wires.http import Endpoint, HttpProvider, classify_status
from calmq.errors import InfrastructureError, StepFailure
from calmq.failure_codes import failure

__all__ = ["MAX_LINE", "BatchClient", "BatchRefused", "BatchResult", "BatchView", "LineError",
           "TooLong", "custom_id", "named", "not_run", "parse_custom_id", "refusal"]

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
class TooLong:
    """A results line longer than the cap: skipped unread but for its first bytes."""

    head: bytes


@dataclass(frozen=True)
class BatchResult:
    """One request's result: a reply the step reads, or the failure the call would raise."""

    custom_id: str
    reply: ModelReply | None = None
    failure: StepFailure | None = None


def not_run(code: str) -> StepFailure:
    return failure(code, f"the provider did not run this request: {code}")


def named(head: bytes) -> str:
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
    """One provider's batch API for one model (the base: sessions, errors, line streaming).
    A provider's client names its ``kind`` (the name its batches are recorded and priced
    under), its ``limits`` per batch (requests, bytes of requests), the path that lists its
    batches (``batches_path``) and its ``online`` wire, which builds each request's body and
    reads each result's reply."""

    kind: ClassVar[str]
    limits: ClassVar[tuple[int, int]]
    batches_path: ClassVar[str]
    online: ClassVar[type[HttpProvider]]

    def __init__(self, base_url: str, api_key: str, model: str, *,
                 endpoint: Endpoint | None = None,
                 structured: Mapping[str, str] | None = None, max_line: int = MAX_LINE) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.api = endpoint or self.online.endpoint_type(base_url, api_key)
        self.max_line = max_line
        self._session: aiohttp.ClientSession | None = None
        self._online = self.online(base_url, api_key, model, endpoint=self.api,
                                   structured=structured)

    @property
    def endpoint(self) -> str:
        """The API's own name of the online endpoint (a batch's ``endpoint``)."""
        return self._online.endpoint

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

    async def _lines(self, url: str) -> AsyncIterator[bytes | TooLong]:
        """The lines of a JSONL download, read in 64 KiB chunks: memory is one line (at most
        ``max_line``) and a chunk. Each chunk is scanned once for its newlines, so a line of
        any length costs its bytes once; a line over ``max_line`` is skipped, unread but for
        its first bytes (``TooLong``)."""
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
                            yield TooLong(skipping)
                            skipping = None
                        elif line.strip():
                            yield bytes(line)
                        line.clear()
                        start = end + 1
                if skipping is not None:
                    yield TooLong(skipping)
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

    def read_line(self, line: bytes | TooLong) -> BatchResult:
        if isinstance(line, TooLong):
            return BatchResult(named(line.head), failure=failure(
                "batch_result_too_large", f"the provider's result for this request is longer "
                f"than {self.max_line} bytes (batch_max_result_line_bytes); not read"))
        try:
            return self._result(line)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            return BatchResult(named(line), failure=failure(
                "batch_result_unreadable", f"the provider's result line for this request is "
                f"not a result: {type(exc).__name__}: {str(exc)[:200]}"))

    def _result(self, line: bytes) -> BatchResult:
        raise NotImplementedError

    async def probe(self) -> object:
        """One tiny online call with this client's key and model (a blocked provider's probe:
        calmq.calls.gate)."""
        return await self._online.complete(messages=[{"role": "user", "content": "ping"}],
                                           job_id="calmq-probe", max_tokens=1)

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
        """The body of one request: the online call's very same."""
        return self._online.request_body(messages=messages, job_id=job_id,
                                         max_tokens=max_tokens, response_schema=response_schema)

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
