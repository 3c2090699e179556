"""The ``embed_document`` example: chunk a document, embed the chunks in batches.

Chunks and vectors live in the object store (they can be large); the step outputs and the
artifact carry references. The artifact is ``{"vectors": {uri, sha256, content_type, size},
"chunks": n, "dimensions": d, "batches": b}``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from calmq.errors import FailureClass, StepFailure
from calmq.gateway import Embedder
from calmq.workflows import RetryPolicy, Step, StepContext, StepOutput, Workflow

__all__ = ["EMBED_DOCUMENT", "EmbedInput", "chunk", "chunk_text", "embed"]


class EmbedInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(min_length=1, max_length=5_000_000)
    chunk_chars: int = Field(default=1000, ge=50, le=100_000)
    batch_size: int = Field(default=16, ge=1, le=2048)


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


def chunk_text(text: str, size: int) -> list[str]:
    """Pieces of at most ``size`` characters, cut at a paragraph or word boundary if any."""
    pieces: list[str] = []
    rest = text.strip()
    while rest:
        if len(rest) <= size:
            pieces.append(rest)
            break
        cut = rest.rfind("\n\n", 0, size)
        if cut < size // 2:
            cut = rest.rfind(" ", 0, size)
        if cut < size // 2:
            cut = size
        pieces.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    return [p for p in pieces if p]


def _objects(ctx: StepContext) -> Any:
    if ctx.objects is None:
        raise StepFailure("this step needs the object store", code="no_object_store",
                          failure_class=FailureClass.BUG)
    return ctx.objects


async def chunk(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    args = EmbedInput.model_validate(
        {k: v for k, v in data.items() if k in EmbedInput.model_fields})
    pieces = chunk_text(args.text, args.chunk_chars)
    if not pieces:
        raise StepFailure("the document has no text", code="empty_document",
                          failure_class=FailureClass.INPUT)
    ref = await _objects(ctx).put(ctx.object_key("chunks.json"), json.dumps(pieces).encode(),
                                  "application/json")
    return StepOutput(artifact={"chunks": ref.as_dict(), "count": len(pieces),
                                "batch_size": args.batch_size})


async def embed(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    if not isinstance(ctx.provider, Embedder):
        raise StepFailure("the configured provider cannot embed", code="no_embeddings",
                          failure_class=FailureClass.PERMISSION)
    objects = _objects(ctx)
    pieces: list[str] = json.loads(await objects.get(data["chunks"]["uri"]))
    size = int(data.get("batch_size", 16))
    vectors: list[list[float]] = []
    tokens = 0
    batches = 0
    for start in range(0, len(pieces), size):
        reply = await ctx.provider.embed(inputs=pieces[start:start + size], job_id=ctx.job_id)
        if len(reply.vectors) != len(pieces[start:start + size]):
            raise StepFailure("the provider answered a different number of vectors",
                              code="malformed_output", failure_class=FailureClass.VERIFIER)
        vectors.extend(reply.vectors)
        tokens += reply.input_tokens
        batches += 1
    body = json.dumps([{"index": i, "vector": v} for i, v in enumerate(vectors)]).encode()
    ref = await objects.put(ctx.object_key("vectors.json"), body, "application/json")
    return StepOutput(
        artifact={"vectors": ref.as_dict(), "chunks": len(vectors),
                  "dimensions": len(vectors[0]) if vectors else 0, "batches": batches},
        input_tokens=tokens,
    )


EMBED_DOCUMENT = Workflow(
    name="embed_document",
    version=1,
    input_model=EmbedInput,
    review_threshold=None,
    steps=(
        Step("chunk", chunk, timeout_seconds=60.0, retry=RetryPolicy(max_attempts=2),
             output_model=Chunked),
        Step("embed", embed, timeout_seconds=300.0, retry=RetryPolicy(max_attempts=3),
             output_model=Embedded),
    ),
)
