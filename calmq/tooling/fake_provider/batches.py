"""The batch APIs: OpenAI's Batch API (files + batches) and Anthropic's Message Batches.

A batch runs by sending each request to this server's own online endpoint (so every per-job
mode behaves exactly as online), after a settable completion delay
(`batch_completion_seconds`, or POST /admin/batches). `expire_next` makes the next N batches
end `expired` with their requests unrun, as a provider does when its 24 h window passes;
`corrupt_next` gives the next batch's results file a line that is not JSON and a line of
`huge_line_bytes` (a provider's results are untrusted input to calmq).
Uploads, creates and each request line are checked as the real APIs check them; a call
without the fake's key, or made during an outage (POST /admin/outage), is refused as the
real API refuses it. Files (OpenAI: `DELETE /v1/files/{id}`) and ended batches (Anthropic:
`DELETE /v1/messages/batches/{id}`) can be deleted, as the real APIs allow; GET
/admin/batches lists what is still held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from aiohttp import BodyPartReader, web

from calmq.tooling.fake_provider import conformance
from calmq.tooling.fake_provider.calls import step_mode, summary_json
from calmq.tooling.fake_provider.online import BATCH_HEADER
from calmq.tooling.fake_provider.settings import FakeProviderSettings

__all__ = ["BatchApis"]

_BATCH_CONCURRENCY: Final = 32


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


@dataclass(slots=True)
class _Batch:
    id: str
    anthropic: bool
    endpoint: str
    requests: list[dict[str, Any]]
    metadata: dict[str, Any]
    created: float
    expire: bool
    status: str = "validating"  # OpenAI's names; Anthropic's processing_status is derived
    corrupt: bool = False
    huge_line_bytes: int = 0
    output: list[bytes] | None = None
    errors: list[bytes] | None = None
    input_file_id: str = ""
    # OpenAI's ``errors.data`` of a batch that failed its validation (each names its line).
    validation: list[dict[str, Any]] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    counts: dict[str, int] | None = None
    ended: float | None = None
    cancel_requested: float | None = None
    task: asyncio.Task[None] | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


class BatchApis:
    """The batch endpoints of one fake provider; state in memory, lost on restart."""

    def __init__(self, settings: FakeProviderSettings,
                 refused: Callable[[str], None] = lambda _m: None,
                 denied: Callable[[web.Request, bool], web.Response | None] = (
                     lambda _r, _a: None)) -> None:
        self.check = settings.check_requests
        self.api_key = settings.api_key
        self.refused = refused  # counts a refusal in /stats beside the online ones
        # The answer to a call without the key or during an outage (None: served).
        self.denied = denied
        self.completion_seconds = settings.batch_completion_seconds
        self.expire_next = 0
        # The next batch's results get a line that is not JSON and one this long (0: none).
        self.corrupt_next = False
        self.huge_line_bytes = 0
        # Seconds a create waits before it answers, the batch already made: a client killed
        # meanwhile has a batch it never heard of (crash-safety tests).
        self.create_delay = 0.0
        self._files: dict[str, tuple[str, bytes]] = {}  # id -> (purpose, bytes)
        self._batches: dict[str, _Batch] = {}
        # Every batch ever created and the custom_ids it carried: deleting a batch (as
        # calmq does once it is collected) keeps the record of what was sent.
        self._made = 0
        self._sent: list[str] = []
        self._session: Any = None

    @staticmethod
    def _unique() -> str:
        """The random part of a batch or file id. The real APIs' ids are unique for good
        (``batch_6a1f...``, ``msgbatch_01...``): a counter restarted with each fake process
        would hand a new fake's batch the id an earlier one's has in the same database."""
        return secrets.token_hex(12)

    # -- OpenAI -------------------------------------------------------------------------

    async def upload_file(self, request: web.Request) -> web.Response:
        if (denied := self.denied(request, False)) is not None:
            return denied
        purpose, data, name = "", b"", "input.jsonl"
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.read()).decode()
            elif part.name == "file":
                name = part.filename or name
                data = bytes(await part.read())
        await conformance.ready()
        refusal = conformance.openai_file_purpose(purpose) if self.check else None
        if refusal is not None:
            self.refused(refusal.message)
            return _openai_error(400, "invalid_request_error", refusal.message)
        if purpose != "batch" or not data:
            return _openai_error(400, "invalid_request_error",
                                 "send a multipart form with purpose=batch and a file")
        file_id = f"file-fake{self._unique()}"
        self._files[file_id] = (purpose, data)
        return web.json_response({"id": file_id, "object": "file", "bytes": len(data),
                                  "created_at": int(time.time()), "filename": name,
                                  "purpose": purpose, "status": "processed"})

    async def create_openai(self, request: web.Request) -> web.Response:
        if (denied := self.denied(request, False)) is not None:
            return denied
        try:
            body = json.loads(await request.read())
            await conformance.ready()
            refusal = conformance.openai_batch_create(body) if self.check else None
            if refusal is not None:
                self.refused(refusal.message)
                return _openai_error(400, refusal.kind, refusal.message)
            file_id = body["input_file_id"]
            endpoint = body["endpoint"]
        except (ValueError, KeyError, TypeError):
            return _openai_error(400, "invalid_request_error",
                                 "input_file_id and endpoint are required")
        if body.get("completion_window") != "24h":
            return _openai_error(400, "invalid_request_error", "completion_window must be 24h")
        stored = self._files.get(file_id)
        if stored is None:
            return _openai_error(404, "invalid_request_error", f"no file {file_id}")
        requests: list[dict[str, Any]] = []
        seen: set[str] = set()
        for number, line in enumerate(stored[1].splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                problem = conformance.openai_batch_line(item, endpoint) if self.check else None
                if problem is None and step_mode(item.get("body")) == "invalid_line":
                    problem = "this request is not valid for the batch (mode invalid_line)"
                if problem is not None:
                    # As OpenAI: the create is taken, and the batch fails its validation.
                    self.refused(f"batch input line {number}: {problem}")
                    return web.json_response(self._failed(
                        endpoint, file_id, body.get("metadata") or {}, number, problem))
                custom_id = str(item["custom_id"])
                if item["url"] != endpoint or custom_id in seen:
                    raise ValueError(custom_id)
            except (ValueError, KeyError, TypeError):
                return _openai_error(400, "invalid_request_error",
                                     "every line needs a unique custom_id and the batch's url")
            seen.add(custom_id)
            requests.append({"custom_id": custom_id, "body": item.get("body") or {}})
        metadata = body.get("metadata") or {}
        batch = self._start(request, anthropic=False, endpoint=endpoint, requests=requests,
                            metadata=dict(metadata), prefix="batch_fake")
        batch.input_file_id = file_id
        await self._delay()
        return web.json_response(self._openai_view(batch, file_id))

    def _failed(self, endpoint: str, file_id: str, metadata: dict[str, Any], line: int,
                problem: str) -> dict[str, Any]:
        """A batch whose input file failed validation: status ``failed``, ``errors``."""
        batch = _Batch(id=f"batch_fake{self._unique()}", anthropic=False, endpoint=endpoint,
                       requests=[], metadata=dict(metadata), created=time.time(),
                       expire=False, status="failed", counts={}, ended=time.time(),
                       input_file_id=file_id, validation=[
                           {"code": "invalid_request", "message": problem, "param": None,
                            "line": line}])
        self._batches[batch.id] = batch
        self._made += 1
        return self._openai_view(batch, file_id)

    async def get_openai(self, request: web.Request) -> web.Response:
        if (denied := self.denied(request, False)) is not None:
            return denied
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or batch.anthropic:
            return _openai_error(404, "invalid_request_error", "no such batch")
        return web.json_response(self._openai_view(batch))

    async def list_openai(self, request: web.Request) -> web.Response:
        if (denied := self.denied(request, False)) is not None:
            return denied
        batches = [b for b in self._batches.values() if not b.anthropic]
        batches.sort(key=lambda b: b.created, reverse=True)
        after = request.query.get("after")
        if after:
            ids = [b.id for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        limit = int(request.query.get("limit", "20"))
        page = batches[:limit]
        return web.json_response({"object": "list", "data": [self._openai_view(b) for b in page],
                                  "first_id": page[0].id if page else None,
                                  "last_id": page[-1].id if page else None,
                                  "has_more": len(batches) > limit})

    async def cancel_openai(self, request: web.Request) -> web.Response:
        if (denied := self.denied(request, False)) is not None:
            return denied
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or batch.anthropic:
            return _openai_error(404, "invalid_request_error", "no such batch")
        self._cancel(batch)
        return web.json_response(self._openai_view(batch))

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        if (denied := self.denied(request, False)) is not None:
            return denied
        stored = self._files.get(request.match_info["file_id"])
        if stored is None:
            return _openai_error(404, "invalid_request_error", "no such file")
        return await _stream(request, [stored[1]])

    async def delete_file(self, request: web.Request) -> web.Response:
        """``DELETE /v1/files/{id}``: OpenAI's ``FileDeleted``."""
        if (denied := self.denied(request, False)) is not None:
            return denied
        file_id = request.match_info["file_id"]
        if self._files.pop(file_id, None) is None:
            return _openai_error(404, "invalid_request_error", f"No such File object: {file_id}")
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    def _openai_view(self, batch: _Batch, file_id: str | None = None) -> dict[str, Any]:
        counts = batch.counts or {}
        return {
            "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
            "input_file_id": file_id or batch.input_file_id or "file-synthetic",
            "completion_window": "24h", "status": batch.status,
            "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
            "created_at": int(batch.created),
            "completed_at": int(batch.ended) if batch.ended and batch.status == "completed"
            else None,
            "expired_at": int(batch.ended) if batch.ended and batch.status == "expired"
            else None,
            "cancelled_at": int(batch.ended) if batch.ended and batch.status == "cancelled"
            else None,
            "failed_at": int(batch.ended) if batch.ended and batch.status == "failed"
            else None,
            "errors": {"object": "list", "data": batch.validation} if batch.validation
            else None,
            "expires_at": int(batch.created + 24 * 3600),
            "request_counts": {"total": len(batch.requests),
                               "completed": counts.get("succeeded", 0),
                               "failed": counts.get("errored", 0)
                               + counts.get("expired", 0) + counts.get("canceled", 0)},
            "metadata": batch.metadata,
        }

    # -- Anthropic ----------------------------------------------------------------------

    async def create_anthropic(self, request: web.Request) -> web.Response:
        if (denied := self.denied(request, True)) is not None:
            return denied
        try:
            body = json.loads(await request.read())
            await conformance.ready()
            refusal = conformance.anthropic_batch(body) if self.check else None
            if refusal is not None:
                self.refused(refusal.message)
                return _anthropic_error(400, refusal.message)
            items = body["requests"]
            requests = [{"custom_id": str(i["custom_id"]), "body": dict(i["params"])}
                        for i in items]
        except (ValueError, KeyError, TypeError):
            return _anthropic_error(400, "requests: a list of {custom_id, params}")
        for n, item in enumerate(requests):
            if step_mode(item["body"]) == "invalid_line":
                message = f"requests.{n}.params: this request is not valid for the batch"
                self.refused(message)
                return _anthropic_error(400, message)
        if not requests or len({r["custom_id"] for r in requests}) != len(requests):
            return _anthropic_error(400, "requests must be non-empty with unique custom_id")
        batch = self._start(request, anthropic=True, endpoint="/v1/messages",
                            requests=requests, metadata={}, prefix="msgbatch_fake")
        await self._delay()
        return web.json_response(self._anthropic_view(request, batch))

    async def get_anthropic(self, request: web.Request) -> web.Response:
        if (denied := self.denied(request, True)) is not None:
            return denied
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or not batch.anthropic:
            return _anthropic_error(404, "no such batch", "not_found_error")
        return web.json_response(self._anthropic_view(request, batch))

    async def list_anthropic(self, request: web.Request) -> web.Response:
        if (denied := self.denied(request, True)) is not None:
            return denied
        batches = [b for b in self._batches.values() if b.anthropic]
        batches.sort(key=lambda b: b.created, reverse=True)
        limit = int(request.query.get("limit", "20"))
        page = batches[:limit]
        return web.json_response({"data": [self._anthropic_view(request, b) for b in page],
                                  "has_more": len(batches) > limit,
                                  "first_id": page[0].id if page else None,
                                  "last_id": page[-1].id if page else None})

    async def cancel_anthropic(self, request: web.Request) -> web.Response:
        if (denied := self.denied(request, True)) is not None:
            return denied
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or not batch.anthropic:
            return _anthropic_error(404, "no such batch", "not_found_error")
        self._cancel(batch)
        return web.json_response(self._anthropic_view(request, batch))

    async def results_anthropic(self, request: web.Request) -> web.StreamResponse:
        if (denied := self.denied(request, True)) is not None:
            return denied
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or not batch.anthropic or batch.output is None:
            return _anthropic_error(404, "no results (yet) for this batch", "not_found_error")
        return await _stream(request, batch.output)

    async def delete_anthropic(self, request: web.Request) -> web.Response:
        """``DELETE /v1/messages/batches/{id}``: the batch and its results; only once it
        ended (an in-progress batch must be cancelled first), as Anthropic's API says."""
        if (denied := self.denied(request, True)) is not None:
            return denied
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or not batch.anthropic:
            return _anthropic_error(404, "no such batch", "not_found_error")
        if batch.ended is None:
            return _anthropic_error(400, f"Message Batch {batch.id} is still processing; "
                                    "cancel it before deleting it")
        del self._batches[batch.id]
        return web.json_response({"id": batch.id, "type": "message_batch_deleted"})

    def _anthropic_view(self, request: web.Request, batch: _Batch) -> dict[str, Any]:
        counts = batch.counts or {}
        ended = batch.ended is not None
        processing = "ended" if ended else (
            "canceling" if batch.cancel_requested else "in_progress")
        return {
            "id": batch.id, "type": "message_batch", "processing_status": processing,
            "request_counts": {"processing": 0 if ended else len(batch.requests),
                               "succeeded": counts.get("succeeded", 0),
                               "errored": counts.get("errored", 0),
                               "canceled": counts.get("canceled", 0),
                               "expired": counts.get("expired", 0)},
            "created_at": _iso(batch.created), "expires_at": _iso(batch.created + 24 * 3600),
            "ended_at": _iso(batch.ended) if batch.ended else None,
            "cancel_initiated_at": _iso(batch.cancel_requested)
            if batch.cancel_requested else None,
            "archived_at": None,
            "results_url": f"{request.url.origin()}/v1/messages/batches/{batch.id}/results"
            if ended else None,
        }

    async def _delay(self) -> None:
        if self.create_delay > 0:
            await asyncio.sleep(self.create_delay)

    # -- the run of a batch -------------------------------------------------------------

    def _start(self, request: web.Request, *, anthropic: bool, endpoint: str,
               requests: list[dict[str, Any]], metadata: dict[str, Any],
               prefix: str) -> _Batch:
        expire = self.expire_next > 0
        if expire:
            self.expire_next -= 1
        batch = _Batch(id=f"{prefix}{self._unique()}", anthropic=anthropic,
                       endpoint=endpoint, requests=requests, metadata=metadata,
                       created=time.time(), expire=expire, corrupt=self.corrupt_next,
                       huge_line_bytes=self.huge_line_bytes)
        self.corrupt_next = False
        self._batches[batch.id] = batch
        self._made += 1
        self._sent += (r["custom_id"] for r in requests)
        batch.task = asyncio.create_task(self._run(batch, str(request.url.origin())))
        return batch

    def _headers(self, batch: _Batch) -> dict[str, str]:
        """A batch's own calls to the online endpoint, authenticated like a client's."""
        headers = {BATCH_HEADER: batch.id}
        if self.api_key:
            headers["x-api-key" if batch.anthropic else "Authorization"] = (
                self.api_key if batch.anthropic else f"Bearer {self.api_key}")
        if batch.anthropic:
            headers["anthropic-version"] = "2023-06-01"
        return headers

    def _cancel(self, batch: _Batch) -> None:
        if batch.ended is not None or batch.cancel_requested:
            return
        batch.cancel_requested = time.time()
        batch.status = "cancelling"
        batch.cancelled.set()

    async def _run(self, batch: _Batch, origin: str) -> None:
        import aiohttp

        batch.status = "in_progress"
        with contextlib.suppress(TimeoutError):  # a cancel ends the wait early
            await asyncio.wait_for(batch.cancelled.wait(), self.completion_seconds)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=_BATCH_CONCURRENCY))
        counts = {"succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        output: list[bytes] = []
        errors: list[bytes] = []
        gate = asyncio.Semaphore(_BATCH_CONCURRENCY)

        async def one(number: int, item: dict[str, Any]) -> None:
            custom_id = item["custom_id"]
            if batch.expire or batch.cancel_requested:
                kind = "expired" if batch.expire else "canceled"
                counts[kind] += 1
                if batch.anthropic:
                    output.append(_line({"custom_id": custom_id, "result": {"type": kind}}))
                else:
                    code = "batch_expired" if batch.expire else "batch_cancelled"
                    errors.append(_line({
                        "id": f"batch_req_{batch.id}_{number}", "custom_id": custom_id,
                        "response": None,
                        "error": {"code": code, "message": f"this request was not run: {code}"}}))
                return
            async with gate, self._session.post(
                    origin + batch.endpoint, json=item["body"],
                    headers=self._headers(batch)) as resp:
                status, body = resp.status, await resp.json(content_type=None)
            ok = status < 300
            counts["succeeded" if ok else "errored"] += 1
            if batch.anthropic:
                result: dict[str, Any] = ({"type": "succeeded", "message": body} if ok
                                          else {"type": "errored", "error": body})
                output.append(_line({"custom_id": custom_id, "result": result}))
            else:
                (output if ok else errors).append(_line({
                    "id": f"batch_req_{batch.id}_{number}", "custom_id": custom_id,
                    "response": {"status_code": status,
                                 "request_id": f"req_{batch.id}_{number}", "body": body},
                    "error": None}))

        await asyncio.gather(*(one(n, r) for n, r in enumerate(batch.requests)))
        if batch.corrupt:
            _corrupt(output or errors, batch.huge_line_bytes)
        batch.status = "finalizing"
        batch.counts = counts
        batch.output, batch.errors = output, errors
        if not batch.anthropic:
            if output:
                batch.output_file_id = f"file-fake{self._unique()}"
                self._files[batch.output_file_id] = ("batch_output", b"".join(output))
            if errors:
                batch.error_file_id = f"file-fake{self._unique()}"
                self._files[batch.error_file_id] = ("batch_output", b"".join(errors))
        batch.ended = time.time()
        batch.status = ("expired" if batch.expire else
                        "cancelled" if batch.cancel_requested else "completed")

    # -- admin --------------------------------------------------------------------------

    async def admin(self, request: web.Request) -> web.Response:
        """POST /admin/batches {"completion_seconds": s, "expire_next": n}; GET: counts."""
        if request.method == "POST":
            try:
                body = json.loads(await request.read())
                if "completion_seconds" in body:
                    self.completion_seconds = max(0.0, float(body["completion_seconds"]))
                if "expire_next" in body:
                    self.expire_next = max(0, int(body["expire_next"]))
                if "create_delay_seconds" in body:
                    self.create_delay = max(0.0, float(body["create_delay_seconds"]))
                if "corrupt_next" in body:
                    self.corrupt_next = bool(body["corrupt_next"])
                    self.huge_line_bytes = max(0, int(body.get("huge_line_bytes", 0)))
            except (ValueError, TypeError, AttributeError):
                return web.json_response(
                    {"error": 'body: {"completion_seconds": s, "expire_next": n, '
                              '"corrupt_next": true, "huge_line_bytes": n}'}, status=400)
        return web.json_response({
            "completion_seconds": self.completion_seconds, "expire_next": self.expire_next,
            "create_delay_seconds": self.create_delay,
            # Every batch created and every request sent, deleted ones included.
            "batches": self._made,
            "by_status": {s: sum(1 for b in self._batches.values() if b.status == s)
                          for s in {b.status for b in self._batches.values()}},
            "requests": len(self._sent),
            "custom_ids": sorted(self._sent),
            # What the fake still holds (deleting a file or a batch removes it here).
            "files": sorted(self._files),
            "batch_ids": sorted(self._batches),
        })

    async def synthetic(self, request: web.Request) -> web.Response:
        """POST /admin/batches/synthetic {"lines": n, "pad": bytes}: a completed OpenAI batch
        whose output file holds ``n`` successful answers padded to about ``pad`` bytes each
        (benchmarks: the poller's memory while it streams a large results file)."""
        try:
            body = json.loads(await request.read())
            lines, pad = int(body["lines"]), int(body.get("pad", 1000))
            corrupt, huge = bool(body.get("corrupt", False)), int(body.get("huge_line_bytes", 0))
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": 'body: {"lines": n, "pad": bytes, '
                                               '"corrupt": bool, "huge_line_bytes": n}'},
                                     status=400)
        filler = "x" * max(0, pad - 400)
        chunks = [_line({
            "id": f"batch_req_syn_{n}", "custom_id": f"synthetic-{n}_1",
            "response": {"status_code": 200, "request_id": f"req_syn_{n}", "body": {
                "id": f"chatcmpl-syn-{n}", "object": "chat.completion", "model": "fake-small",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "refusal": None,
                    "content": summary_json(f"synthetic {n} {filler}", 0.97)}}],
                "usage": {"prompt_tokens": 20, "completion_tokens": 20, "total_tokens": 40}}},
            "error": None}) for n in range(lines)]
        if corrupt:
            _corrupt(chunks, huge)
        batch = _Batch(id=f"batch_fake{self._unique()}", anthropic=False,
                       endpoint="/v1/chat/completions", requests=[], metadata={},
                       created=time.time(), expire=False, status="completed",
                       counts={"succeeded": lines}, ended=time.time())
        batch.output_file_id = f"file-fake{self._unique()}"
        self._files[batch.output_file_id] = ("batch_output", b"".join(chunks))
        self._batches[batch.id] = batch
        return web.json_response({**self._openai_view(batch),
                                  "bytes": len(self._files[batch.output_file_id][1])})

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/admin/batches/synthetic", self.synthetic)
        for prefix in ("/v1", "/openai/v1"):  # OpenAI; Azure OpenAI's v1 API
            app.router.add_post(f"{prefix}/files", self.upload_file)
            app.router.add_get(f"{prefix}/files/{{file_id}}/content", self.file_content)
            app.router.add_delete(f"{prefix}/files/{{file_id}}", self.delete_file)
            app.router.add_post(f"{prefix}/batches", self.create_openai)
            app.router.add_get(f"{prefix}/batches", self.list_openai)
            app.router.add_get(f"{prefix}/batches/{{batch_id}}", self.get_openai)
            app.router.add_post(f"{prefix}/batches/{{batch_id}}/cancel", self.cancel_openai)
        app.router.add_post("/v1/messages/batches", self.create_anthropic)
        app.router.add_get("/v1/messages/batches", self.list_anthropic)
        app.router.add_get("/v1/messages/batches/{batch_id}", self.get_anthropic)
        app.router.add_delete("/v1/messages/batches/{batch_id}", self.delete_anthropic)
        app.router.add_post("/v1/messages/batches/{batch_id}/cancel", self.cancel_anthropic)
        app.router.add_get("/v1/messages/batches/{batch_id}/results", self.results_anthropic)
        app.router.add_route("*", "/admin/batches", self.admin)

        async def close(_app: web.Application) -> None:
            for batch in self._batches.values():
                if batch.task is not None:
                    batch.task.cancel()
            if self._session is not None:
                await self._session.close()

        app.on_cleanup.append(close)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _corrupt(lines: list[bytes], huge: int) -> None:
    """The first line cut off mid-JSON (its custom_id still readable), and the second
    padded to ``huge`` bytes (0: left as it is): what a results file may hold that calmq
    must survive."""
    if lines:
        lines[0] = lines[0][:len(lines[0]) // 2] + b"\n"
    if len(lines) > 1 and huge > len(lines[1]):
        head = lines[1].rstrip(b"\n")
        # Inside the JSON (a string of padding in a field of its own): still one line.
        lines[1] = head[:-1] + b',"padding":"' + b"x" * (huge - len(head)) + b'"}\n'


async def _stream(request: web.Request, chunks: list[bytes]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/jsonl"})
    resp.content_length = sum(len(c) for c in chunks)
    await resp.prepare(request)
    for chunk in chunks:
        await resp.write(chunk)
    await resp.write_eof()
    return resp


def _openai_error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": None,
                                        "param": None}}, status=status)


def _anthropic_error(status: int, message: str,
                     kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"type": "error", "error": {"type": kind, "message": message}},
                             status=status)

