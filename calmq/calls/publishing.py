"""A job's output as the model writes it: a streamed step's text, from the worker that runs
the step to every client that follows the job (docs/how-to/stream-output.md).

On the worker:

- ``PublishingProvider`` is the provider a step sees during an attempt: the text of its
  streamed calls (``ctx.provider.stream``, or every call of a step with ``stream``) goes
  to the attempt's ``OutputStream`` as it arrives.
- ``OutputStream`` is one attempt's stream of one step, named by the attempt's fencing
  token (so a later attempt's stream sorts after, and a stale worker's never passes for the
  current one). It coalesces the deltas into chunks: the first at once (the time to the
  first token is what a person notices), then at most one every ``flush_seconds`` (50 ms),
  numbered 1, 2, ... with the offset of their text. ``close`` writes the rest and returns
  once every chunk is written, so the chunks of an attempt are committed before its
  outcome (and before the ``completed`` event a client sees last).
- ``OutputWriter`` group-commits the chunks of every stream of the process
  (calmq.group_commit.GroupCommitter, one writer, in order): one statement writes a group and its
  ``NOTIFY calmq_job_output``, retried while the database is away
  (calmq.data.outputs).

For the readers, ``Position`` is where a client is in a job's events: the last history
event, and in the output the stream, seq and offset after the last delta; it is the SSE
event id the client sends back as ``Last-Event-ID``.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from calmq.calls.wires import ModelReply, ModelStream, Provider, Streamer
from calmq.data.outputs import OutputChunk, Outputs
from calmq.errors import ContractError
from calmq.group_commit import GroupCommitter
from calmq.retrying import RECONNECT
from calmq.storable import clean, storable

__all__ = ["OutputStream", "OutputWriter", "Position", "PublishingProvider"]


@dataclass(frozen=True, slots=True)
class Position:
    """Where a reader of a job's events is: ``history``, the id of the last history event
    it received; ``stream``, ``seq`` and ``offset``, the output stream of its last delta,
    that delta's number and the offset after its text (all 0 before any delta). As an SSE
    event id: ``"H"`` before any delta (the history event's id, as always), else
    ``"H:S:N:O"``."""

    history: int = 0
    stream: int = 0
    seq: int = 0
    offset: int = 0

    @property
    def event_id(self) -> str:
        if not self.stream:
            return str(self.history)
        return f"{self.history}:{self.stream}:{self.seq}:{self.offset}"

    @classmethod
    def parse(cls, raw: str) -> Position:
        """A position from an event id this API sent (``ContractError`` otherwise)."""
        parts = raw.strip().split(":")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) not in (1, 4) or min(numbers) < 0:
            raise ContractError("Last-Event-ID (or after) is the id of an event this stream "
                                "sent", code="invalid_header")
        return cls(*numbers)


class OutputWriter:
    """One process's writer of streamed text (see the module docstring)."""

    def __init__(self, outputs: Outputs, *, flush_seconds: float = 0.05,
                 window: float = 0.002) -> None:
        self.flush_seconds = flush_seconds
        # One writer: the groups are written in the order their chunks came, so a stream's
        # last chunk written means all of it is. Retried while the database is away: the
        # step waits for its chunks before its outcome is written.
        self._batcher: GroupCommitter[OutputChunk] = GroupCommitter(
            "output-writer", self._write, window=window, max_batch=500, retry=RECONNECT)
        self._outputs = outputs

    async def _write(self, chunks: list[OutputChunk]) -> None:
        await self._outputs.append(chunks)

    def open(self, job_id: uuid.UUID, stream: int, step: str, attempt: int) -> OutputStream:
        return OutputStream(self, job_id, stream, step, attempt)

    def queue(self, chunk: OutputChunk) -> asyncio.Future[None]:
        return self._batcher.queue(chunk)

    async def close(self, grace: float = 5.0) -> None:
        await self._batcher.close(grace)


class OutputStream:
    """One attempt's stream of one step's text (see the module docstring)."""

    def __init__(self, writer: OutputWriter, job_id: uuid.UUID, stream: int, step: str,
                 attempt: int) -> None:
        self._writer = writer
        self.job_id = job_id
        self.stream = stream
        self.step = step
        self.attempt = attempt
        self.seq = 0
        self.offset = 0
        self._pending: list[str] = []
        self._flushed_at = -math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._last: asyncio.Future[None] | None = None

    def add(self, text: str) -> None:
        """A delta: written at once when nothing was for ``flush_seconds``, else with what
        comes until then."""
        if not text:
            return
        self._pending.append(text)
        if self._timer is not None:
            return
        loop = asyncio.get_running_loop()
        wait = self._flushed_at + self._writer.flush_seconds - loop.time()
        if wait <= 0:
            self._flush()
        else:
            self._timer = loop.call_later(wait, self._flush)

    def _flush(self) -> None:
        self._timer = None
        if not self._pending:
            return
        text = "".join(self._pending)
        self._pending.clear()
        if not storable(text):  # a NUL from the model: the step fails on it anyway
            text = clean(text)
        self.seq += 1
        chunk = OutputChunk(self.job_id, self.stream, self.seq, self.step, self.attempt,
                            self.offset, text)
        self.offset += len(text)
        self._flushed_at = asyncio.get_running_loop().time()
        self._last = self._writer.queue(chunk)

    async def close(self) -> None:
        """Write what is left; return once every chunk of the stream is written."""
        if self._timer is not None:
            self._timer.cancel()
        self._flush()
        if self._last is not None:
            await asyncio.shield(self._last)


class PublishingProvider:
    """The provider a step sees during an attempt (see the module docstring): the worker's
    provider, whose streamed calls' text also goes to ``output``; with ``stream_calls``
    (the step's ``stream``), ``complete`` is a streamed call. Anything else (``embed``, the
    batch lane's own attributes) is the worker's provider's."""

    def __init__(self, inner: Provider, output: OutputStream | None, *,
                 stream_calls: bool = False) -> None:
        self.inner = inner
        self.output = output
        self.stream_calls = stream_calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def complete(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                       response_schema: dict[str, Any] | None = None) -> ModelReply:
        if self.stream_calls and isinstance(self.inner, Streamer):
            return await self.stream(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                     response_schema=response_schema).final()
        return await self.inner.complete(messages=messages, job_id=job_id,
                                         max_tokens=max_tokens,
                                         response_schema=response_schema)

    def stream(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
               response_schema: dict[str, Any] | None = None) -> ModelStream:
        """A streamed call whose text also goes to the attempt's output; a provider that
        cannot stream (the batch lane's) answers whole, as one delta."""
        inner, output = self.inner, self.output

        async def source(out: ModelStream) -> AsyncIterator[str]:
            if not isinstance(inner, Streamer):
                reply = await inner.complete(messages=messages, job_id=job_id,
                                             max_tokens=max_tokens,
                                             response_schema=response_schema)
                if reply.content:
                    if output is not None:
                        output.add(reply.content)
                    yield reply.content
                out.reply = reply
                return
            streamed = inner.stream(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                    response_schema=response_schema)
            try:
                async for text in streamed:
                    if output is not None:
                        output.add(text)
                    yield text
                out.reply = await streamed.final()
            finally:
                await streamed.aclose()

        return ModelStream(source)

    async def close(self) -> None:
        return None  # the worker's provider is the worker's to close
