"""The ``invoice`` example: extract text (PDF or plain text) -> extract fields with the model
-> a person reviews when the model's confidence is below 0.9 -> post to a ledger, once.

The ledger is any HTTP endpoint that accepts ``POST <ledger_url>`` with a JSON posting and an
``Idempotency-Key`` header (the job id and step), and answers the same posting for the same
key. ``ledger_url`` is the setting of that name.
"""

from __future__ import annotations

import asyncio
import io
import json
from functools import cache
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from calmq.calls.output_schemas import read_answer
from calmq.errors import FailureClass, StepFailure
from calmq.workflows import (
    ByReference,
    RetryPolicy,
    ReviewExpiry,
    Step,
    StepContext,
    StepOutput,
    Workflow,
)
from calmq.workflows.effects import once

__all__ = [
    "INVOICE_BY_REFERENCE",
    "INVOICE_SYSTEM_PROMPT",
    "InvoiceAnswer",
    "InvoiceFields",
    "InvoiceInput",
    "extract_fields",
    "extract_text",
    "invoice_workflow",
    "pdf_text",
]

INVOICE_SYSTEM_PROMPT = (
    "Extract the invoice fields from the user's text. Answer only with JSON: "
    '{"vendor": string, "invoice_number": string, "total": number, "currency": string, '
    '"confidence": number between 0 and 1}.'
)


class InvoiceInput(BaseModel):
    """The text of the invoice, or (multipart upload) a PDF or text file as ``input_ref``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(min_length=1, max_length=200_000)
    # Knobs of the fake provider, passed through to it (docs/reference/fake-provider.md).
    mode: str | None = Field(default=None, max_length=40)
    fail_times: int | None = Field(default=None, ge=0, le=100)
    delay_ms: int | None = Field(default=None, ge=0, le=600_000)


class InvoiceText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)
    mode: str | None = None
    fail_times: int | None = None
    delay_ms: int | None = None


class InvoiceFields(BaseModel):
    """What the model must return, and what a reviewer may correct."""

    model_config = ConfigDict(extra="ignore")

    vendor: str = Field(min_length=1)
    invoice_number: str = Field(min_length=1)
    total: float
    currency: str = Field(min_length=3, max_length=3)


class InvoiceAnswer(InvoiceFields):
    """What the model is asked for: the fields and its confidence in them. Under strict
    structured outputs a property the schema lacks cannot be sent, so the confidence the
    review threshold reads must be part of the schema."""

    confidence: float = Field(default=1.0, ge=0, le=1)


@cache
def _answer_schema() -> dict[str, Any]:
    # Built once: the gateway derives each provider's dialect once per schema object.
    return InvoiceAnswer.model_json_schema()


class LedgerPosted(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fields: InvoiceFields
    posting: dict[str, Any]


def pdf_text(data: bytes) -> str:
    """The text layer of a PDF (no OCR: a scanned image has none)."""
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        return "\n".join(page.extract_text() or "" for page in reader.pages).strip()
    except (PdfReadError, ValueError, KeyError) as exc:
        raise StepFailure(f"the PDF cannot be read: {exc}", code="unreadable_pdf",
                          failure_class=FailureClass.INPUT) from exc


async def extract_text(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    """Text of the invoice: from the input, or from the uploaded PDF or text file."""
    text = data.get("text") if isinstance(data.get("text"), str) else None
    ref = data.get("input_ref")
    if isinstance(ref, str) and ctx.objects is not None:
        # pypdf needs the whole file: read it bounded by what the API checked. (Imported
        # here: the client distribution loads workflows but ships no object store.)
        from calmq.objects import read_bounded

        raw = await read_bounded(ctx.objects, ref, INVOICE_BY_REFERENCE.max_bytes)
        if raw.startswith(b"%PDF"):
            text = await asyncio.to_thread(pdf_text, raw)
        else:
            text = raw.decode("utf-8", "replace")
    if not text or not text.strip():
        raise StepFailure("the invoice has no text to read", code="empty_invoice",
                          failure_class=FailureClass.INPUT)
    knobs = {k: data[k] for k in ("mode", "fail_times", "delay_ms") if data.get(k) is not None}
    return StepOutput(artifact={"text": text.strip(), **knobs})


async def extract_fields(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    """Ask the model for the invoice fields; its confidence decides whether a person looks."""
    reply = await ctx.provider.complete(
        messages=[
            {"role": "system", "content": INVOICE_SYSTEM_PROMPT},
            {"role": "user",
             "content": json.dumps({k: v for k, v in data.items() if v is not None})},
        ],
        job_id=ctx.job_id,
        max_tokens=256,
        response_schema=_answer_schema(),
    )
    if reply.refusal:
        raise StepFailure(f"the model refused: {reply.refusal[:200]}", code="model_refusal",
                          failure_class=FailureClass.POLICY)
    try:
        answer = read_answer(InvoiceAnswer, reply.content or "")
    except (ValueError, ValidationError) as exc:
        raise StepFailure(
            f"model output is not the invoice schema: {(reply.content or '')[:120]!r}",
            code="malformed_output", failure_class=FailureClass.VERIFIER,
        ) from exc
    fields = InvoiceFields.model_validate(answer.model_dump(exclude={"confidence"}))
    return StepOutput(artifact=fields.model_dump(mode="json"), confidence=answer.confidence,
                      input_tokens=reply.input_tokens, output_tokens=reply.output_tokens)


def _post_to(ledger_url: str) -> Any:
    async def post_ledger(ctx: StepContext, data: dict[str, Any]) -> StepOutput:
        """Post the (reviewed) fields to the ledger, keyed by the job: once."""
        if not ledger_url:
            raise StepFailure("no ledger_url is set for the invoice workflow",
                              code="ledger_not_configured", failure_class=FailureClass.INPUT)
        fields = InvoiceFields.model_validate(data).model_dump(mode="json")

        async def call(key: str) -> dict[str, Any]:
            body = {"job_id": ctx.job_id, "fields": fields}
            try:
                async with aiohttp.ClientSession() as session, session.post(
                    ledger_url, json=body, headers={"Idempotency-Key": key},
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as resp:
                    text = await resp.text()
                    if resp.status >= 500 or resp.status == 429:
                        raise StepFailure(f"the ledger answered {resp.status}: {text[:200]}",
                                          code="ledger_unavailable",
                                          failure_class=FailureClass.TRANSIENT)
                    if resp.status >= 300:
                        raise StepFailure(f"the ledger refused the posting ({resp.status}): "
                                          f"{text[:200]}", code="ledger_rejected",
                                          failure_class=FailureClass.INPUT)
                    answer = json.loads(text) if text else {}
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise StepFailure(f"cannot reach the ledger: {exc}", code="ledger_unreachable",
                                  failure_class=FailureClass.TRANSIENT) from exc
            return answer if isinstance(answer, dict) else {"answer": answer}

        posting = await once(ctx, "ledger", call)
        return StepOutput(artifact={"fields": fields, "posting": posting})

    return post_ledger


# A PDF (its text layer is read: no OCR) or a text file; the first step reads it itself.
INVOICE_BY_REFERENCE = ByReference(
    frozenset({"application/pdf", "text/plain"}), max_bytes=20 * 1024 * 1024, streams=True)


def invoice_workflow(
    ledger_url: str,
    *,
    name: str = "invoice",
    version: int = 1,
    pool: str = "default",
    text_pool: str | None = None,
    model_pool: str | None = None,
    ledger_pool: str | None = None,
    review_threshold: float = 0.9,
    review_deadline_seconds: float | None = None,
    review_expiry: ReviewExpiry = "dead_letter",
) -> Workflow:
    """The invoice workflow, posting to ``ledger_url``; each step may run on its own pool."""
    return Workflow(
        name=name,
        version=version,
        input_model=InvoiceInput,
        pool=pool,
        review_threshold=review_threshold,
        review_deadline_seconds=review_deadline_seconds,
        review_expiry=review_expiry,
        by_reference=INVOICE_BY_REFERENCE,
        steps=(
            Step("extract_text", extract_text, timeout_seconds=60.0, pool=text_pool,
                 retry=RetryPolicy(max_attempts=2), output_model=InvoiceText),
            Step("extract_fields", extract_fields, timeout_seconds=60.0, pool=model_pool,
                 retry=RetryPolicy(max_attempts=3), output_model=InvoiceFields),
            Step("post_ledger", _post_to(ledger_url), timeout_seconds=30.0, pool=ledger_pool,
                 retry=RetryPolicy(max_attempts=5, initial_seconds=2.0),
                 output_model=LedgerPosted),
        ),
    )
