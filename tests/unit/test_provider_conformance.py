"""Conformance with the real providers: every request calmq can make is built from
``calmq.workflows`` as registered and checked with the official ``openai`` and ``anthropic``
SDKs' request types and the documented structured-output rules; every answer is read
through the SDKs' response types. The fake provider runs in-process with the same checks."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from anthropic.types import Message
from anthropic.types.messages import (
    DeletedMessageBatch,
    MessageBatch,
    MessageBatchIndividualResponse,
)
from openai.types import Batch, CreateEmbeddingResponse, FileDeleted, FileObject
from openai.types.chat import ChatCompletion

from calmq.calls.batch_apis import custom_id, open_batch_client
from calmq.calls.wires import EmbeddingReply, ModelReply, open_provider
from calmq.errors import StepFailure
from calmq.objects import open_object_store
from calmq.settings import Settings
from calmq.tooling.fake_provider import FakeProviderSettings, build_app
from calmq.tooling.fake_provider import conformance as rules
from calmq.workflows import StepContext, load_workflows

INVOICE = "Vendor: ACME GmbH\nInvoice: 2024-17\nTotal: EUR 120.50\n"


class Recorder:
    """A provider that records each call a step makes and answers like a model would."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.embeds: list[list[str]] = []

    async def complete(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                       response_schema: dict[str, Any] | None = None) -> ModelReply:
        self.calls.append({"messages": messages, "job_id": job_id, "max_tokens": max_tokens,
                           "response_schema": response_schema})
        props = set((response_schema or {}).get("properties") or {})
        answer: dict[str, Any] = {"summary": "short", "confidence": None}
        if "vendor" in props:
            answer = {"vendor": "ACME", "invoice_number": "17", "total": 1.0,
                      "currency": "EUR", "confidence": 0.5}
        return ModelReply(json.dumps(answer), None, 10, 10)

    async def embed(self, *, inputs: list[str], job_id: str) -> EmbeddingReply:
        self.embeds.append(inputs)
        return EmbeddingReply([[0.1, 0.2] for _ in inputs], 5)

    async def close(self) -> None:
        return None


async def _record(tmp_path: Path) -> Recorder:
    """Every built-in workflow run step by step (each step's output the next one's input)
    with a recording provider: the calls calmq's own steps make."""
    recorder = Recorder()
    objects = open_object_store(f"file://{tmp_path}")
    inputs = {"summarize": {"text": "A long text about queues. " * 20},
              "invoice": {"text": INVOICE},
              "embed_document": {"text": "Paragraph one.\n\nParagraph two. " * 50,
                                 "chunk_chars": 200}}
    workflows = load_workflows(Settings())
    assert set(inputs) <= set(workflows)  # the built-ins, as registered

    async def run(name: str, data: dict[str, Any], n: int) -> dict[str, Any] | None:
        """The workflow's steps in turn, as the worker runs them: a step that spawns
        children has each child run to its artifact, and the next step gets them in input
        order (embed_document's batches are embed_batch children)."""
        workflow = workflows[name]
        current: dict[str, Any] = workflow.validate_input(data)
        for step in workflow.steps:
            ctx = StepContext(str(uuid.UUID(int=n)), "11111111-1111-1111-1111-111111111111",
                              step.name, 1, recorder, objects, workflow=name)
            try:
                out = await step.run(ctx, current)
            except StepFailure:
                return None  # the invoice's ledger step (no ledger here): no call after it
            current = step.check_output(out.artifact)
            if out.spawn is not None:
                children = []
                for i, child in enumerate(out.spawn.inputs):
                    artifact = await run(out.spawn.workflow, child, n * 1000 + i + 1)
                    children.append({"index": i, "status": "completed", "error": None,
                                     "artifact": await _stored(objects, ctx, i, artifact)})
                current = {**current, "children": children}
        return current

    for n, (name, data) in enumerate(inputs.items(), 1):
        await run(name, data, n)
    return recorder


async def _stored(objects: Any, ctx: StepContext, i: int,
                  artifact: dict[str, Any] | None) -> dict[str, Any]:
    """A child's artifact as the worker leaves it for the joining step: stored, by ref."""
    ref = await objects.put(ctx.object_key(f"child-{i}.json"),
                            json.dumps(artifact).encode(), "application/json")
    return dict(ref.as_dict())


@pytest.fixture
async def recorded(tmp_path: Path) -> Recorder:
    recorder = await _record(tmp_path)
    assert len(recorder.calls) >= 2
    assert recorder.embeds
    return recorder


@pytest.mark.parametrize("kind", ["openai", "azure"])
async def test_every_chat_request_fits_the_openai_sdk_and_strict_mode(
        recorded: Recorder, kind: str) -> None:
    """Each workflow's model call, as the OpenAI (and Azure) adapter sends it, is a
    CompletionCreateParams the SDK allows, with a strict schema OpenAI accepts."""
    provider = open_provider(kind, "http://unused", "k", "gpt-4o-mini")
    for call in recorded.calls:
        body = provider.request_body(**call)
        assert rules.openai_chat(body) is None, rules.openai_chat(body)
        spec = body["response_format"]["json_schema"]
        assert spec["strict"] is True
        assert rules.openai_strict_problems(spec["schema"]) == []


@pytest.mark.parametrize("tier", ["flex", "priority"])
async def test_every_chat_request_with_a_service_tier_fits_the_openai_sdk(
        recorded: Recorder, tier: str) -> None:
    """Each workflow's model call sent at a service tier calmq may choose
    (calmq.calls.tiers) is still a CompletionCreateParams the SDK allows, and the strict fake
    answers it at that tier."""
    from calmq.calls.wires import SERVICE_TIER

    provider = open_provider("openai", "http://unused", "k", "gpt-5-mini")
    token = SERVICE_TIER.set(tier)
    try:
        for call in recorded.calls:
            body = provider.request_body(**call)
            assert body["service_tier"] == tier
            assert rules.openai_chat(body) is None, rules.openai_chat(body)
    finally:
        SERVICE_TIER.reset(token)


async def test_every_message_request_fits_the_anthropic_sdk(recorded: Recorder) -> None:
    """Each workflow's model call, as the Anthropic adapter sends it, is a
    MessageCreateParams the SDK allows, with the schema in output_config.format."""
    provider = open_provider("anthropic", "http://unused", "k", "claude-sonnet-4-5")
    for call in recorded.calls:
        body = provider.request_body(**call)
        assert rules.anthropic_messages(body) is None, rules.anthropic_messages(body)
        assert body["output_config"]["format"]["type"] == "json_schema"
    old = open_provider("anthropic", "http://unused", "k", "claude-3-5-haiku-latest")
    assert all("output_config" not in old.request_body(**c) for c in recorded.calls)


@pytest.mark.parametrize("kind", ["openai", "azure", "anthropic"])
async def test_every_streamed_request_fits_the_sdks_streaming_params(
        recorded: Recorder, kind: str) -> None:
    """Each workflow's model call, streamed: OpenAI's CompletionCreateParamsStreaming with
    stream_options.include_usage (else the stream reports no usage to settle), Anthropic's
    MessageCreateParamsStreaming; the same call otherwise."""
    from anthropic.types.message_create_params import MessageCreateParamsStreaming
    from openai.types.chat.completion_create_params import CompletionCreateParamsStreaming

    from calmq.tooling.fake_provider.sdk_types import check

    model = "claude-sonnet-4-5" if kind == "anthropic" else "gpt-4o-mini"
    provider = open_provider(kind, "http://unused", "k", model)
    for call in recorded.calls:
        body = provider.stream_body(**call)
        whole = provider.request_body(**call)
        assert body["stream"] is True
        if kind == "anthropic":
            assert check(body, MessageCreateParamsStreaming) == []
            assert rules.anthropic_messages(body) is None
            assert {k: v for k, v in body.items() if k != "stream"} == whole
        else:
            assert check(body, CompletionCreateParamsStreaming) == []
            assert rules.openai_chat(body) is None
            assert body["stream_options"] == {"include_usage": True}
            assert {k: v for k, v in body.items()
                    if k not in ("stream", "stream_options")} == whole


def test_the_rules_refuse_what_the_apis_refuse_of_a_stream() -> None:
    """stream_options without stream (OpenAI), stream_options at all (Anthropic has none),
    a stream flag that is not a boolean, a streamed line in a batch: each refused."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    message = {**chat, "max_tokens": 5}
    refused = rules.openai_chat({**chat, "stream_options": {"include_usage": True}})
    assert refused is not None
    assert refused.param == "stream_options"
    assert rules.openai_chat({**chat, "stream": False,
                              "stream_options": {"include_usage": True}}) is not None
    assert rules.openai_chat({**chat, "stream": "yes"}) is not None
    assert rules.openai_chat({**chat, "stream": True,
                              "stream_options": {"include_usage": "yes"}}) is not None
    assert rules.anthropic_messages({**message, "stream": True,
                                     "stream_options": {"include_usage": True}}) is not None
    assert rules.anthropic_messages({**message, "stream": True}) is None
    assert rules.openai_batch_line({"custom_id": "a", "method": "POST",
                                    "url": "/v1/chat/completions",
                                    "body": {**chat, "stream": True}},
                                   "/v1/chat/completions") is not None
    assert rules.anthropic_batch({"requests": [{"custom_id": "a", "params": {
        **message, "stream": True}}]}) is not None


async def test_embedding_requests_fit_the_openai_sdk(recorded: Recorder) -> None:
    """embed_document's embedding calls are EmbeddingCreateParams the SDK allows."""
    provider = open_provider("openai", "http://unused", "k", "text-embedding-3-small")
    for inputs in recorded.embeds:
        assert rules.openai_embeddings(provider.embeddings_body(inputs, "job")) is None


async def test_batch_lines_fit_both_batch_apis(recorded: Recorder) -> None:
    """A batch's lines: OpenAI's input-file lines carry a valid chat body; Anthropic's
    requests are a BatchCreateParams the SDK allows."""
    openai = open_batch_client("openai", "http://unused", "k", "gpt-4o-mini")
    anthropic = open_batch_client("anthropic", "http://unused", "k", "claude-sonnet-4-5")
    for n, call in enumerate(recorded.calls):
        cid = custom_id(f"00000000-0000-0000-0000-00000000000{n}", 1)
        line = json.loads(openai.line(cid, openai.request_body(**call)))
        assert rules.openai_batch_line(line, "/v1/chat/completions") is None
        item = json.loads(anthropic.line(cid, anthropic.request_body(**call)))
        assert rules.anthropic_batch({"requests": [item]}) is None


@pytest.fixture
async def fake() -> AsyncIterator[str]:
    app = build_app(FakeProviderSettings(batch_completion_seconds=0.05))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _get(url: str, path: str, headers: dict[str, str] | None = None) -> Any:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url + path, headers=headers) as resp:
        return await resp.json(content_type=None)


@pytest.mark.parametrize("kind", ["openai", "azure", "anthropic"])
async def test_calls_and_answers_against_the_strict_fake(
        recorded: Recorder, fake: str, kind: str) -> None:
    """Online and batch, the fake (which checks like the real API) refuses nothing calmq
    sends, and its answers read through the SDKs' response types."""
    import aiohttp

    model = "claude-sonnet-4-5" if kind == "anthropic" else "fake-small"
    base = fake + "/openai/v1" if kind == "azure" else fake
    provider = open_provider(kind, base, "k", model)
    client = open_batch_client(kind, base, "k", model)
    try:
        for call in recorded.calls:
            reply = await provider.complete(**call)
            assert reply.content
        if kind != "anthropic":
            assert (await provider.embed(inputs=["a", "b"], job_id="j")).vectors
        lines = [client.line(custom_id(f"job-{n}", 1), client.request_body(**call))
                 for n, call in enumerate(recorded.calls)]
        view = await client.create(lines, "conformance")
        for _ in range(200):
            view = await client.view(view.provider_id)
            if view.ended:
                break
            await asyncio.sleep(0.02)  # poll: the fake's batch runs for 50 ms
        results = [r async for r in client.results(view)]
        assert len(results) == len(lines)
        assert all(r.reply for r in results)
        stats = await _get(fake, "/stats")
        assert (stats["refused"], stats["refusals"]) == (0, [])
        # The answers in the SDKs' own response types.
        async with aiohttp.ClientSession() as s:
            if kind == "anthropic":
                body = provider.request_body(**recorded.calls[0])
                async with s.post(fake + "/v1/messages", json=body,
                                  headers=provider.endpoint_config.headers()) as resp:
                    Message.model_validate(await resp.json())
                MessageBatch.model_validate(await _get(
                    fake, f"/v1/messages/batches/{view.provider_id}"))
                async with s.get(view.results[0]) as resp:
                    for line in (await resp.read()).splitlines():
                        MessageBatchIndividualResponse.model_validate_json(line)
                # calmq deletes an ended batch (DELETE /v1/messages/batches/{id}).
                async with s.delete(f"{fake}/v1/messages/batches/{view.provider_id}",
                                    headers=provider.endpoint_config.headers()) as resp:
                    DeletedMessageBatch.model_validate(await resp.json())
            else:
                headers = provider.endpoint_config.headers()
                body = provider.request_body(**recorded.calls[0])
                async with s.post(f"{base}/chat/completions" if kind == "azure" else
                                  f"{fake}/v1/chat/completions", json=body,
                                  headers=headers) as resp:
                    ChatCompletion.model_validate(await resp.json())
                async with s.post(f"{fake}/v1/embeddings", json=provider.embeddings_body(
                        ["x"], "j"), headers=headers) as resp:
                    CreateEmbeddingResponse.model_validate(await resp.json())
                Batch.model_validate(await _get(fake, f"/v1/batches/{view.provider_id}"))
                async with s.get(f"{fake}/v1/files/{view.results[0]}/content") as resp:
                    for line in (await resp.read()).splitlines():
                        ChatCompletion.model_validate(json.loads(line)["response"]["body"])
                form = aiohttp.FormData()
                form.add_field("purpose", "batch")
                form.add_field("file", b"{}", filename="x.jsonl")
                async with s.post(f"{fake}/v1/files", data=form) as resp:
                    uploaded = FileObject.model_validate(await resp.json())
                # calmq deletes a collected batch's files (DELETE /v1/files/{id}).
                async with s.delete(f"{base if kind == 'azure' else fake + '/v1'}/files/"
                                    f"{uploaded.id}", headers=headers) as resp:
                    assert FileDeleted.model_validate(await resp.json()).deleted
                # Every file of the batch, deleted through calmq's own client.
                await client.delete(view)
                held = set((await _get(fake, "/admin/batches"))["files"])
                assert view.input_file
                assert not {view.input_file, *view.results} & held
    finally:
        await provider.close()
        await client.close()


@pytest.mark.parametrize("kind", ["openai", "azure", "anthropic"])
async def test_streamed_calls_against_the_strict_fake(
        recorded: Recorder, fake: str, kind: str) -> None:
    """Streamed, every call calmq's workflows make is refused by nothing, and its text
    arrives in deltas that add up to the reply."""
    model = "claude-sonnet-4-5" if kind == "anthropic" else "fake-small"
    base = fake + "/openai/v1" if kind == "azure" else fake
    provider = open_provider(kind, base, "k", model)
    try:
        for call in recorded.calls:
            stream = provider.stream(**call)
            deltas = [text async for text in stream]
            reply = await stream.final()
            assert reply.content
            assert "".join(deltas) == reply.content
            assert reply.output_tokens > 0
    finally:
        await provider.close()
    stats = await _get(fake, "/stats")
    assert (stats["refused"], stats["refusals"]) == (0, [])


async def test_the_fake_refuses_the_schema_calmq_used_to_send(fake: str) -> None:
    """The pydantic schema as it comes (no additionalProperties, confidence not required)
    is refused with OpenAI's 400 body, and counted as refused."""
    import aiohttp

    from calmq.workflows.summarize import SummaryOutput

    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "output", "schema": SummaryOutput.model_json_schema(), "strict": True}}}
    async with aiohttp.ClientSession() as s, s.post(fake + "/v1/chat/completions",
                                                    json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert "additionalProperties" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (await _get(fake, "/stats"))["refused"] == 1


async def test_azure_deployment_urls_and_the_api_key_header(fake: str) -> None:
    """Azure OpenAI: a deployment URL with api-version, the v1 API, and the key in the
    api-key header (never Authorization); without api-version the deployment URL is 404."""
    deployment = open_provider("azure", f"{fake}/openai/deployments/my-gpt", "az-key",
                               "gpt-4o-mini", api_version="2024-10-21")
    v1 = open_provider("azure", f"{fake}/openai/v1", "az-key", "gpt-4o-mini")
    missing = open_provider("azure", f"{fake}/openai/deployments/my-gpt", "az-key",
                            "gpt-4o-mini")
    messages = [{"role": "user", "content": json.dumps({"text": "a b c"})}]
    try:
        for provider in (deployment, v1):
            reply = await provider.complete(messages=messages, job_id="j", max_tokens=16)
            assert reply.content
            assert (await provider.embed(inputs=["x"], job_id="j")).vectors
        with pytest.raises(StepFailure) as missed:
            await missing.complete(messages=messages, job_id="j", max_tokens=16)
        assert missed.value.code == "model_not_found"  # a 404: the fleet's configuration
    finally:
        for provider in (deployment, v1, missing):
            await provider.close()
    calls = (await _get(fake, "/admin/calls"))["calls"]
    assert {c["auth"] for c in calls} == {"api-key"}
    assert {c["path"] for c in calls} >= {"/openai/deployments/my-gpt/chat/completions",
                                         "/openai/v1/chat/completions",
                                         "/openai/v1/embeddings"}
    assert (await _get(fake, "/stats"))["refused"] == 0


async def test_openai_compatible_servers_get_the_extra_headers(fake: str) -> None:
    """An OpenAI-compatible server (vLLM, Ollama, a LiteLLM proxy): the OpenAI paths, a
    Bearer key when one is set, and CALMQ_PROVIDER_EXTRA_HEADERS on every call, batches
    included."""
    provider = open_provider("openai", f"{fake}/v1", "sk-litellm", "llama-3.1-8b",
                             extra_headers={"X-Team": "search"})
    client = open_batch_client("openai", f"{fake}/v1", "sk-litellm", "llama-3.1-8b",
                               extra_headers={"X-Team": "search"})
    try:
        messages = [{"role": "user", "content": json.dumps({"text": "a b c"})}]
        assert (await provider.complete(messages=messages, job_id="j", max_tokens=8)).content
        await client.create([client.line("job-1_1", client.request_body(
            messages=messages, job_id="job-1", max_tokens=8))], "k")
    finally:
        await provider.close()
        await client.close()
    calls = (await _get(fake, "/admin/calls"))["calls"]
    assert calls
    assert all(c["auth"] == "bearer" and "X-Team" in c["headers"] for c in calls
               if c["job"] != "job-1")


async def test_a_key_the_fake_requires_is_checked_in_each_shape() -> None:
    """--require-key: a wrong key is the provider's 401 (calmq: provider_auth, a pause)."""
    app = build_app(FakeProviderSettings(api_key="right"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    messages = [{"role": "user", "content": "x"}]
    try:
        for kind in ("openai", "azure", "anthropic"):
            base = f"{url}/openai/v1" if kind == "azure" else url
            wrong = open_provider(kind, base, "wrong", "claude-sonnet-4-5")
            right = open_provider(kind, base, "right", "claude-sonnet-4-5")
            try:
                with pytest.raises(StepFailure) as refused:
                    await wrong.complete(messages=messages, job_id="j", max_tokens=8)
                assert refused.value.code == "provider_auth"
                assert (await right.complete(messages=messages, job_id="j", max_tokens=8))
            finally:
                await wrong.close()
                await right.close()
    finally:
        await runner.cleanup()


# A stable prefix of about 4,000 tokens (the fake counts four characters a token), marked at
# its last message: on the system prompt, or on a document the user turn carries.
_PREFIX = "You answer questions about the attached handbook. " + "Handbook text. " * 1066


def _cached_calls() -> list[dict[str, Any]]:
    """Calls whose prompt marks a stable prefix (calmq.calls.caching), as steps make them."""
    from calmq.calls.caching import stable
    from calmq.workflows.summarize import _output_schema

    question = {"role": "user", "content": json.dumps({"text": "What is a lease?"})}
    return [
        {"messages": [stable({"role": "system", "content": _PREFIX}), question],
         "job_id": "job-a", "max_tokens": 64, "response_schema": _output_schema()},
        {"messages": [{"role": "system", "content": "Answer with JSON."},
                      stable({"role": "user", "content": _PREFIX}), question],
         "job_id": "job-b", "max_tokens": 64, "response_schema": _output_schema()},
        {"messages": [stable({"role": "system", "content": _PREFIX}),
                      {"role": "system", "content": "Be brief."}, question],
         "job_id": "job-c", "max_tokens": 64},
    ]


@pytest.fixture
def cache_scope() -> Iterator[None]:
    from calmq.calls.wires import CallScope, enter_scope

    enter_scope(CallScope("job-a", "tenant-acme-0001", "handbook", "bulk"))
    yield
    enter_scope(CallScope())  # the scope of no job, as before


@pytest.mark.parametrize("kind", ["openai", "azure", "anthropic"])
def test_requests_with_a_cached_prefix_fit_the_sdks(kind: str, cache_scope: None) -> None:
    """A marked prefix goes out as each provider caches it, and every such request (whole,
    streamed, in a batch) is one the official SDK's request types allow: OpenAI and Azure a
    prompt_cache_key of the workflow and tenant (a hash: neither name in it), Anthropic
    cache_control on the prefix's last block; the mark itself never reaches the wire."""
    from anthropic.types.message_create_params import MessageCreateParamsStreaming
    from openai.types.chat.completion_create_params import CompletionCreateParamsStreaming

    from calmq.calls.caching import cache_key
    from calmq.tooling.fake_provider.sdk_types import check

    model = "claude-sonnet-4-5" if kind == "anthropic" else "gpt-4o-mini"
    provider = open_provider(kind, "http://unused", "k", model)
    batch = open_batch_client(kind, "http://unused", "k", model)
    for n, call in enumerate(_cached_calls()):
        body = provider.request_body(**call)
        stream = provider.stream_body(**call)
        line = json.loads(batch.line(custom_id(f"job-{n}", 1), batch.request_body(**call)))
        assert "cache" not in json.dumps(body["messages"]).replace("cache_control", "")
        if kind == "anthropic":
            assert rules.anthropic_messages(body) is None, rules.anthropic_messages(body)
            assert check(stream, MessageCreateParamsStreaming) == []
            assert rules.anthropic_batch({"requests": [line]}) is None
            marked = [b for b in (body["system"] if isinstance(body["system"], list) else [])
                      + [b for m in body["messages"] if isinstance(m["content"], list)
                         for b in m["content"]] if "cache_control" in b]
            assert [b["cache_control"] for b in marked] == [{"type": "ephemeral"}]
            assert marked[0]["text"] == _PREFIX
        else:
            assert rules.openai_chat(body) is None, rules.openai_chat(body)
            assert check(stream, CompletionCreateParamsStreaming) == []
            assert rules.openai_batch_line(line, "/v1/chat/completions") is None
            assert body["prompt_cache_key"] == cache_key("handbook", "tenant-acme-0001")
            assert "acme" not in body["prompt_cache_key"]
            assert "handbook" not in body["prompt_cache_key"]
    # Without a mark, the request is the one calmq always sent.
    plain = provider.request_body(messages=[{"role": "user", "content": "x"}], job_id="j",
                                  max_tokens=8)
    assert "prompt_cache_key" not in plain
    assert "cache_control" not in json.dumps(plain)


def test_a_mark_left_on_a_message_is_refused_by_the_sdk_rules() -> None:
    """Why the mark is taken off: a message with a key the SDK's types lack is refused."""
    body = {"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": "x", "cache": "prefix"}]}
    assert rules.openai_chat(body) is not None


def test_a_cache_mark_of_another_value_is_refused() -> None:
    """A typo in the mark raises instead of silently caching nothing."""
    from calmq.calls.caching import prefix_length

    with pytest.raises(ValueError, match="prefix"):
        prefix_length([{"role": "system", "content": "x", "cache": "yes"}])
    assert prefix_length([{"role": "system", "content": "x"}]) == 0


@pytest.mark.parametrize("kind", ["openai", "azure", "anthropic"])
async def test_cached_prefixes_against_the_strict_fake(fake: str, kind: str,
                                                       cache_scope: None) -> None:
    """The fake (which checks like the real API) refuses none of the cached requests; the
    second call of a prefix reads it from the cache (Anthropic's first writes it), and the
    usage reaches the reply."""
    model = "claude-sonnet-4-5" if kind == "anthropic" else "fake-small"
    base = fake + "/openai/v1" if kind == "azure" else fake
    provider = open_provider(kind, base, "k", model)
    try:
        for call in _cached_calls():
            first = await provider.complete(**call)
            again = await provider.complete(**call)
            assert first.content
            assert again.cached_input_tokens >= 3_900
            assert again.cached_input_tokens <= again.input_tokens
            if kind == "anthropic":
                assert first.cache_write_tokens >= 3_900 or first.cached_input_tokens
    finally:
        await provider.close()
    stats = await _get(fake, "/stats")
    assert (stats["refused"], stats["refusals"]) == (0, [])
    assert stats["cached_input_tokens"] >= 3 * 3_900
