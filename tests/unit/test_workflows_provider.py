"""The fake provider's answers for the workflow examples, over real HTTP: invoice fields
when the system prompt asks for them, and OpenAI-shaped embeddings, through the gateway."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from calmq.calls.wires import OpenAIProvider
from calmq.tooling.fake_provider import FakeProviderSettings, build_app
from calmq.workflows.invoice import INVOICE_SYSTEM_PROMPT

INVOICE = "Vendor: ACME Tools\nInvoice #: INV-77\nTotal: USD 1,002.25"


@pytest_asyncio.fixture
async def provider() -> AsyncIterator[tuple[OpenAIProvider, str]]:
    server: TestServer[web.Request, web.Application] = TestServer(
        build_app(FakeProviderSettings(low_confidence=0.4)))
    await server.start_server()
    base = str(server.make_url("")).rstrip("/")
    gateway = OpenAIProvider(base, "", "fake-small")
    yield gateway, base
    await gateway.close()
    await server.close()


async def _complete(gateway: OpenAIProvider, system: str, user: dict[str, object]) -> dict:  # type: ignore[type-arg]
    reply = await gateway.complete(
        messages=[{"role": "system", "content": system},
                  {"role": "user", "content": json.dumps(user)}],
        job_id="job-9", max_tokens=64)
    return dict(json.loads(reply.content or ""))


async def test_invoice_prompt_gets_invoice_fields(provider: tuple[OpenAIProvider, str]) -> None:
    """A system prompt asking for invoice fields gets them, read from the text, with the
    mode's confidence; other prompts still get a summary."""
    gateway, _base = provider
    answer = await _complete(gateway, INVOICE_SYSTEM_PROMPT, {"text": INVOICE})
    assert answer == {"vendor": "ACME Tools", "invoice_number": "INV-77", "total": 1002.25,
                      "currency": "USD", "confidence": 0.97}
    low = await _complete(gateway, INVOICE_SYSTEM_PROMPT,
                          {"text": INVOICE, "mode": "low_confidence"})
    assert low["confidence"] == 0.4
    summary = await _complete(gateway, "Summarize the user's text.", {"text": INVOICE})
    assert set(summary) == {"summary", "confidence"}


async def test_embeddings_are_deterministic_unit_vectors_counted_per_job(
    provider: tuple[OpenAIProvider, str]
) -> None:
    """/v1/embeddings answers one 8-dimension unit vector per input, the same for the same
    text, and counts the call for the job in /stats."""
    gateway, base = provider
    first = await gateway.embed(inputs=["a", "b", "a"], job_id="job-e")
    assert len(first.vectors) == 3
    assert first.vectors[0] == first.vectors[2] != first.vectors[1]
    assert abs(sum(x * x for x in first.vectors[0]) - 1) < 1e-4
    async with gateway.session().get(base + "/stats") as resp:
        stats = await resp.json()
    assert stats["by_job"]["job-e"]["calls"] == 1
