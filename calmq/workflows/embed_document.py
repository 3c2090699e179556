"""The ``embed_document`` example: chunk a document, embed the chunks in batches.

Each batch is a child job (``embed_batch``, docs/how-to/fan-out.md) with its own retries,
and the vectors step joins their vectors in chunk order. Chunks and vectors live in the
object store (they can be large); the step outputs and the artifact carry references. The
artifact is ``{"vectors": {uri, sha256, content_type, size}, "chunks": n, "dimensions": d,
"batches": b}``.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from calmq.calls.wires import Embedder
from calmq.errors import ContractError, FailureClass, StepFailure
from calmq.workflows import ByReference, RetryPolicy, Step, StepContext, StepOutput, Workflow

__all__ = ["EMBED_BATCH", "EMBED_BY_REFERENCE", "EMBED_DOCUMENT", "EmbedBatchInput",
           "EmbedInput", "chunk", "chunk_stream", "chunk_text", "embed", "embed_batch",
           "join_vectors"]


class EmbedInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(min_length=1, max_length=5_000_000)
    chunk_chars: int = Field(default=1000, ge=50, le=100_000)
    batch_size: int = Field(default=16, ge=1, le=2048)


class EmbedByRef(BaseModel):
    """The knobs of a document sent by reference (defaults: the inline input's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    chunk_chars: int = Field(default=1000, ge=50, le=100_000)
    batch_size: int = Field(default=16, ge=1, le=2048)


# A text document of up to 20 MB; the chunk step reads it in chunks itself.
EMBED_BY_REFERENCE = ByReference(frozenset({"text/plain", "text/markdown"}),
                                 max_bytes=20 * 1024 * 1024, streams=True)


class Chunked(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunks: dict[str, Any]  # the chunks' object reference
    count: int = Field(ge=1)
    batch_size: int = Field(ge=1)


class Embedded(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vectors: dict[str, Any]  # the vectors' object reference
    chunks: int
    dimensions: int
    batches: int


def _cut(rest: str, size: int) -> int:
    """Where the first piece of ``rest`` (longer than ``size``) ends."""
    cut = rest.rfind("\n\n", 0, size)
    if cut < size // 2:
        cut = rest.rfind(" ", 0, size)
    if cut < size // 2:
        cut = size
    return cut


def chunk_text(text: str, size: int) -> list[str]:
    """Pieces of at most ``size`` characters, cut at a paragraph or word boundary if any."""
    pieces: list[str] = []
    rest = text.strip()
    while rest:
        if len(rest) <= size:
            pieces.append(rest)
            break
        cut = _cut(rest, size)
        pieces.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    return [p for p in pieces if p]


async def chunk_stream(chunks: AsyncIterator[bytes], size: int, limit: int) -> list[str]:
    """``chunk_text`` of a UTF-8 document read chunk by chunk: the same pieces, while the
    document's bytes are never held whole (only the pieces, and at most one piece and one
    chunk of text not yet cut). ContractError ``input_too_large`` past ``limit`` bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pieces: list[str] = []
    rest = ""
    read = 0
    started = False
    async for data in chunks:
        read += len(data)
        if read > limit:
            raise ContractError(f"the document is over the {limit} byte limit for input by "
                                "reference", code="input_too_large", status=413)
        rest += decoder.decode(data)
        if not started:
            rest = rest.lstrip()
            started = bool(rest)
        # Cut only what more text cannot change: a piece needs up to ``size`` characters
        # after its start to find its boundary, and the rest is stripped after each cut.
        while len(rest) > 2 * size:
            cut = _cut(rest, size)
            piece = rest[:cut].strip()
            if piece:
                pieces.append(piece)
            rest = rest[cut:].lstrip()
    pieces.extend(chunk_text(rest + decoder.decode(b"", final=True), size))
    return pieces


def _objects(ctx: StepContext) -> Any:
    if ctx.objects is None:
        raise StepFailure("this step needs the object store", code="no_object_store",
                          failure_class=FailureClass.BUG)
    return ctx.objects


async def chunk(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    ref = data.get("input_ref")
    if isinstance(ref, str):  # a document by reference: read in chunks, never whole
        # (imported here: the client distribution loads workflows but ships no object store)
        from calmq.objects import iter_chunks

        knobs = EmbedByRef.model_validate({k: v for k, v in data.items() if k != "input_ref"})
        pieces = await chunk_stream(iter_chunks(_objects(ctx), ref), knobs.chunk_chars,
                                    EMBED_BY_REFERENCE.max_bytes)
        return await _store_chunks(ctx, pieces, knobs.batch_size)
    args = EmbedInput.model_validate(
        {k: v for k, v in data.items() if k in EmbedInput.model_fields})
    return await _store_chunks(ctx, chunk_text(args.text, args.chunk_chars), args.batch_size)


async def _store_chunks(ctx: StepContext, pieces: list[str], batch_size: int) -> StepOutput:
    if not pieces:
        raise StepFailure("the document has no text", code="empty_document",
                          failure_class=FailureClass.INPUT)
    ref = await _objects(ctx).put(ctx.object_key("chunks.json"), json.dumps(pieces).encode(),
                                  "application/json")
    return StepOutput(artifact={"chunks": ref.as_dict(), "count": len(pieces),
                                "batch_size": batch_size})


class EmbedBatchInput(BaseModel):
    """One batch of a document's chunks (``embed_batch``, a child job of embed_document):
    pieces ``start`` to ``stop`` of the chunks object."""

    model_config = ConfigDict(extra="forbid", strict=True)

    chunks: str = Field(min_length=1, max_length=2048)  # the chunks object's uri
    start: int = Field(ge=0)
    stop: int = Field(ge=1)


class Batch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start: int
    vectors: list[list[float]]


async def embed(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    """One child job per batch of chunks (``embed_batch``, on this step's pool), joined when
    all succeed: a transient failure retries its own batch, never a batch already paid for."""
    args = Chunked.model_validate(data)
    uri = str(args.chunks["uri"])
    inputs = [{"chunks": uri, "start": start, "stop": min(start + args.batch_size, args.count)}
              for start in range(0, args.count, args.batch_size)]
    return ctx.spawn(EMBED_BATCH.name, inputs, join="all", pool=ctx.pool or None,
                     output=args.model_dump(mode="json"))


async def embed_batch(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    """Embed pieces ``start`` to ``stop`` of the chunks: the batch's vectors are its artifact."""
    if not isinstance(ctx.provider, Embedder):
        raise StepFailure("the configured provider cannot embed", code="no_embeddings",
                          failure_class=FailureClass.PERMISSION)
    args = EmbedBatchInput.model_validate(data)
    pieces: list[str] = json.loads(await _objects(ctx).get(args.chunks))[args.start:args.stop]
    if not pieces:
        raise StepFailure(f"no chunks {args.start} to {args.stop} in {args.chunks}",
                          code="invalid_input", failure_class=FailureClass.INPUT)
    reply = await ctx.provider.embed(inputs=pieces, job_id=ctx.job_id)
    if len(reply.vectors) != len(pieces):
        raise StepFailure("the provider answered a different number of vectors",
                          code="malformed_output", failure_class=FailureClass.VERIFIER)
    return StepOutput(artifact={"start": args.start, "vectors": reply.vectors},
                      input_tokens=reply.input_tokens)


async def join_vectors(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    """The batches' vectors in chunk order, stored as one object: the document's artifact."""
    objects = _objects(ctx)
    vectors: list[list[float]] = []
    children = data["children"]
    for child in children:
        batch = Batch.model_validate_json(await objects.get(child["artifact"]["uri"]))
        if batch.start != len(vectors):
            raise StepFailure(f"batch {child['index']} starts at chunk {batch.start}, not "
                              f"{len(vectors)}", code="missing_step_output",
                              failure_class=FailureClass.BUG)
        vectors.extend(batch.vectors)
    body = json.dumps([{"index": i, "vector": v} for i, v in enumerate(vectors)]).encode()
    ref = await objects.put(ctx.object_key("vectors.json"), body, "application/json")
    return StepOutput(
        artifact={"vectors": ref.as_dict(), "chunks": len(vectors),
                  "dimensions": len(vectors[0]) if vectors else 0, "batches": len(children)})


# The child job of embed_document: one batch of chunks. Its own retries: a transient failure
# of one batch costs that batch's call again, not the document's.
EMBED_BATCH = Workflow(
    name="embed_batch",
    version=1,
    input_model=EmbedBatchInput,
    review_threshold=None,
    steps=(Step("embed", embed_batch, timeout_seconds=120.0, retry=RetryPolicy(max_attempts=3),
                output_model=Batch),),
)

# Version 2: the embeddings are child jobs (embed_batch) joined by the vectors step; version
# 1 embedded every batch in one step, so one transient failure paid for all of them again.
EMBED_DOCUMENT = Workflow(
    name="embed_document",
    version=2,
    input_model=EmbedInput,
    review_threshold=None,
    by_reference=EMBED_BY_REFERENCE,
    steps=(
        Step("chunk", chunk, timeout_seconds=60.0, retry=RetryPolicy(max_attempts=2),
             output_model=Chunked),
        Step("embed", embed, timeout_seconds=60.0, retry=RetryPolicy(max_attempts=3)),
        Step("vectors", join_vectors, timeout_seconds=300.0,
             retry=RetryPolicy(max_attempts=3), output_model=Embedded),
    ),
)
