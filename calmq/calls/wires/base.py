"""The model call's values, shared by every provider's wire and every wrapper: the call's
scope (``CallScope``: whose calls these are), the attempt's clock (``ModelClock``: model time,
tokens and cost), the answer (``ModelReply``, ``ModelStream``, ``EmbeddingReply``) and the
interfaces a provider offers (``Provider``, ``Streamer``, ``Embedder``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from calmq.calls import caching
from calmq.failure_codes import failure
from calmq.jobs import Priority

__all__ = [
    "SERVICE_TIER",
    "CallScope",
    "Embedder",
    "EmbeddingReply",
    "ModelClock",
    "ModelReply",
    "ModelStream",
    "Provider",
    "Streamer",
    "current_clock",
    "current_scope",
    "enter_scope",
    "model_clock",
]


@dataclass(frozen=True)
class CallScope:
    """Whose model calls these are: the budget's priority, the cost metrics' labels.

    The step runner enters one per job attempt; a step's ``provider.complete`` calls made in
    that task see it without every step having to pass it along.
    """

    job_id: str = ""
    tenant_id: str = ""
    workflow: str = ""
    priority: str = Priority.BULK
    # Wall time (epoch seconds) by which the call must have answered: the earlier of the
    # job's deadline and the end of the step's timeout; None: no bound (calmq.calls.tiers).
    deadline: float | None = None


_SCOPE: ContextVar[CallScope | None] = ContextVar("calmq_call_scope", default=None)


def enter_scope(scope: CallScope) -> None:
    """Set the scope for the rest of the current task.

    Each job attempt runs in its own asyncio task, which holds its own copy of the context,
    so a scope never leaks to another job.
    """
    _SCOPE.set(scope)


def current_scope() -> CallScope:
    return _SCOPE.get() or CallScope()


class ModelClock:
    """One attempt's model calls: seconds spent waiting for the answers (calls summed) and
    the calls' tokens and cost, which the step runner writes in the same transaction as the
    attempt's outcome instead of one more transaction per call.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.cost_usd = 0.0
        # Of the input: read from and written to the provider's prompt cache, and what the
        # cache saved (calmq.calls.caching).
        self.cached_input_tokens = 0
        self.cache_write_tokens = 0
        self.cache_saved_usd = 0.0
        # The model that served the attempt's last call (a step may fall back to another
        # of its allowed models: calmq.calls.fallback); None before any answered call.
        self.model: str | None = None
        # Per call asked at a service tier: {model, chosen, served[, moved, moved_ms]}
        # (calmq.calls.tiers), for the attempt's event in the job's history.
        self.tiers: list[dict[str, Any]] = []

    def add_usage(self, input_tokens: int, output_tokens: int, cost_usd: float,
                  model: str | None = None, cache: caching.CacheUse | None = None) -> None:
        self.calls += 1
        if cache is not None:
            self.cached_input_tokens += cache.read
            self.cache_write_tokens += cache.written
            self.cache_saved_usd += cache.saved_usd
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.cost_usd += cost_usd
        if model is not None:
            self.model = model


# The service tier the call being sent in this task asks for (calmq.calls.tiers sets it
# around one call); None: the request names none (the provider's default tier).
SERVICE_TIER: ContextVar[str | None] = ContextVar("calmq_service_tier", default=None)

_CLOCK: ContextVar[ModelClock | None] = ContextVar("calmq_model_clock", default=None)


def model_clock() -> ModelClock:
    """Start timing and metering the current task's model calls (the runner does, once per
    attempt): model time against the rest of an attempt is what the metrics split, and the
    usage goes into the attempt's outcome."""
    clock = ModelClock()
    _CLOCK.set(clock)
    return clock


def current_clock() -> ModelClock | None:
    return _CLOCK.get()


@dataclass(frozen=True)
class ModelReply:
    content: str | None
    refusal: str | None
    input_tokens: int
    output_tokens: int
    # Of the input tokens, those the provider served from its prompt cache (cheaper); of the
    # output tokens, those spent reasoning; the service tier the provider says it served.
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0
    service_tier: str | None = None
    # Of the input tokens, those written to the prompt cache (Anthropic's cache writes).
    cache_write_tokens: int = 0


class Provider(Protocol):
    async def complete(
        self,
        *,
        messages: list[dict[str, str]],
        job_id: str,
        max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> ModelReply: ...

    async def close(self) -> None: ...


class ModelStream:
    """One streamed model call: ``async for text in stream`` gives the text as the model
    writes it; once the stream has ended, ``reply`` holds the whole answer and its usage, as
    ``complete`` would have returned it. ``await stream.final()`` reads whatever is left and
    returns the reply. Nothing is sent before the first read; a stream is read once.

    A stream that breaks off after it began is ``stream_interrupted`` (transient: the next
    attempt starts a new stream); one refused before it began fails as ``complete`` would.
    """

    def __init__(self, source: Callable[[ModelStream], AsyncIterator[str]]) -> None:
        # ``source(self)`` yields the deltas and sets ``reply`` once the provider ended it.
        self._source = source
        self._iterator: AsyncIterator[str] | None = None
        self.reply: ModelReply | None = None

    def __aiter__(self) -> ModelStream:
        return self

    async def __anext__(self) -> str:
        if self._iterator is None:
            self._iterator = aiter(self._source(self))
        return await anext(self._iterator)

    async def final(self) -> ModelReply:
        """The reply, once every delta is read (those not read yet are read here)."""
        async for _text in self:
            pass
        if self.reply is None:
            raise failure("stream_interrupted", "the model's stream ended without its reply")
        return self.reply

    async def aclose(self) -> None:
        """Stop reading (the connection is closed); a stream left unread needs no close."""
        iterator = self._iterator
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()


@runtime_checkable
class Streamer(Protocol):
    """A provider that can stream a call (calmq's gateway providers and their budget)."""

    def stream(
        self,
        *,
        messages: list[dict[str, str]],
        job_id: str,
        max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> ModelStream: ...


@dataclass(frozen=True)
class EmbeddingReply:
    vectors: list[list[float]]
    input_tokens: int


@runtime_checkable
class Embedder(Protocol):
    """A provider that also embeds text (OpenAI-compatible ``POST /v1/embeddings``)."""

    async def embed(self, *, inputs: list[str], job_id: str) -> EmbeddingReply: ...
