"""Workflow definitions, the registry, durable progress, and the example steps run alone
(no Kafka, no database): fakes implement the real Provider, ObjectStore and EffectLog."""

from __future__ import annotations

import hashlib
import json
import sys
import types
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel

from calmq.calls.wires import EmbeddingReply, ModelReply
from calmq.data import Database, Job
from calmq.data.steps import StepRecord
from calmq.errors import ConfigError, FailureClass, StepFailure
from calmq.jobs import Status
from calmq.objects import ObjectRef
from calmq.settings import Settings
from calmq.workflows import (
    RetryPolicy,
    Step,
    StepContext,
    StepOutput,
    Workflow,
    builtin_workflows,
    load_workflows,
)
from calmq.workflows.effects import MemoryEffectLog, once
from calmq.workflows.embed_document import EMBED_BATCH, EMBED_DOCUMENT, chunk_text
from calmq.workflows.invoice import (
    InvoiceFields,
    extract_fields,
    extract_text,
    invoice_workflow,
    pdf_text,
)
from calmq.workflows.progress import STEP_COMPLETED, Progress
from tests.support.ledger import Ledger
from tests.support.pdf import tiny_pdf


class FakeProvider:
    """Answers every completion with ``content``; embeds each input as [len, 1.0]."""

    def __init__(self, content: str = "", refusal: str | None = None) -> None:
        self.content = content
        self.refusal = refusal
        self.calls: list[list[dict[str, str]]] = []
        self.embedded: list[list[str]] = []

    async def complete(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                       response_schema: dict[str, Any] | None = None) -> ModelReply:
        self.calls.append(messages)
        return ModelReply(self.content, self.refusal, 10, 5)

    async def embed(self, *, inputs: list[str], job_id: str) -> EmbeddingReply:
        self.embedded.append(inputs)
        return EmbeddingReply([[float(len(i)), 1.0] for i in inputs], len(inputs))

    async def close(self) -> None:
        pass


class MemoryObjects:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    async def put(self, key: str, data: bytes, content_type: str) -> ObjectRef:
        uri = f"mem://{key}"
        self.data[uri] = data
        return ObjectRef(uri, hashlib.sha256(data).hexdigest(), content_type, len(data))

    async def get(self, uri: str) -> bytes:
        return self.data[uri]


def ctx(provider: Any = None, *, step: str = "s", objects: Any = None,
        effects: Any = None) -> StepContext:
    return StepContext("job-1", "tenant-1", step, 1, provider or FakeProvider(), objects, effects)


async def _noop(_ctx: StepContext, data: dict[str, Any]) -> StepOutput:
    return StepOutput(data)


class _In(BaseModel):
    text: str


def _three_steps(**kw: Any) -> Workflow:
    return Workflow("three", 1, _In, (Step("a", _noop), Step("b", _noop, pool="gpu"),
                                      Step("c", _noop, retry=RetryPolicy(max_attempts=7))), **kw)


# -- definitions and registry --------------------------------------------------------------


def test_workflow_knows_the_order_pools_and_budgets_of_its_steps() -> None:
    """next_step/previous_step follow the list; a step's pool defaults to the workflow's;
    a step's attempt budget comes from its retry policy when it has one."""
    wf = _three_steps(pool="cpu")
    assert [wf.next_step(s.name).name if wf.next_step(s.name) else None
            for s in wf.steps] == ["b", "c", None]
    assert wf.previous_step("a") is None
    assert wf.previous_step("c").name == "b"
    assert [wf.pool_of(s) for s in wf.steps] == ["cpu", "gpu", "cpu"]
    assert [s.attempts for s in wf.steps] == [3, 3, 7]


def test_workflow_refuses_duplicate_step_names() -> None:
    """Two steps of one name would make the recorded progress ambiguous: refused."""
    with pytest.raises(ValueError, match="twice"):
        Workflow("dup", 1, _In, (Step("a", _noop), Step("a", _noop)))


def test_retry_policy_never_retries_its_non_retryable_classes() -> None:
    """A transient failure retries unless the policy lists its class; others never do."""
    transient = StepFailure("503", code="x", failure_class=FailureClass.TRANSIENT)
    policy = RetryPolicy(non_retryable=frozenset({FailureClass.TRANSIENT}))
    assert RetryPolicy().retries(transient)
    assert not policy.retries(transient)
    assert not RetryPolicy().retries(StepFailure("?", code="x", failure_class=FailureClass.INPUT))


def test_step_output_model_turns_a_misfit_into_malformed_output() -> None:
    """A step output that does not fit its output model is a verifier failure."""
    step = Step("fields", _noop, output_model=InvoiceFields)
    with pytest.raises(StepFailure) as info:
        step.check_output({"vendor": "x"})
    assert (info.value.code, info.value.failure_class) == ("malformed_output",
                                                           FailureClass.VERIFIER)


@pytest.fixture
def app_module() -> Iterator[types.ModuleType]:
    module = types.ModuleType("calmq_test_app_workflows")
    module.workflows = lambda settings: [  # type: ignore[attr-defined]
        replace(_three_steps(), name=f"app_{settings.pool}")]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_registry_adds_workflows_of_the_module_setting(app_module: types.ModuleType) -> None:
    """workflow_modules registers a module's workflows(settings) next to the built-ins."""
    registry = load_workflows(Settings(workflow_modules=app_module.__name__, pool="blue"))
    assert {"summarize", "invoice", "embed_document", "app_blue"} <= set(registry)


def test_registry_refuses_a_second_workflow_of_the_same_name(
    app_module: types.ModuleType
) -> None:
    """A module that registers a built-in's name again is a ConfigError, not a silent swap."""
    app_module.workflows = lambda: [replace(_three_steps(), name="summarize")]  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as info:
        load_workflows(Settings(workflow_modules=app_module.__name__))
    assert info.value.code == "duplicate_workflow"


def test_registry_names_a_module_it_cannot_import() -> None:
    """An unimportable workflow module fails with a stable code and its name."""
    with pytest.raises(ConfigError, match="no_such_module") as info:
        load_workflows(Settings(workflow_modules="no_such_module"))
    assert info.value.code == "invalid_workflow_module"


def test_builtin_invoice_posts_to_the_ledger_url_setting() -> None:
    """The shipped examples are registered; invoice reads ledger_url from the settings."""
    registry = builtin_workflows(Settings(ledger_url="http://ledger.example/postings"))
    assert [s.name for s in registry["invoice"].steps] == ["extract_text", "extract_fields",
                                                           "post_ledger"]
    assert registry["invoice"].review_threshold == 0.9


# -- durable progress ----------------------------------------------------------------------


JOB = Job(id=uuid.UUID("00000000-0000-0000-0000-000000000001"),
          tenant_id=uuid.UUID("00000000-0000-0000-0000-000000000002"), workflow="three",
          workflow_version=1, priority="bulk", pool="cpu", step="a", attempt=2, max_attempts=3,
          input={"text": "x"}, input_ref=None, metadata={}, deadline_at=None,
          trace_parent=None, created_at=datetime(2026, 1, 1, tzinfo=UTC), old_status="queued")


def _progress(objects: MemoryObjects) -> Progress:
    return Progress(Database("postgresql://unused"), objects, review_deadline_seconds=60)


async def test_a_finished_step_records_its_output_and_queues_the_next_on_its_pool() -> None:
    """A step's success records its output and, in the same Finish, moves the job to the
    next step with a fresh attempt budget and a job.requested on that step's pool route."""
    finish = await _progress(MemoryObjects()).succeeded(
        replace(JOB, step="a"), _three_steps(pool="cpu"), StepOutput({"x": 1}), "w1")
    assert (finish.status, finish.event_type, finish.next_step) == ("queued", STEP_COMPLETED, "b")
    assert finish.reset_attempt
    assert finish.artifact is None
    assert finish.record == {"state": "done", "output": {"x": 1}, "confidence": None,
                             "next_pool": "gpu", "next_max_attempts": 3}
    [out] = finish.outbox
    assert out.route == "gpu.bulk"
    assert out.type == "job.requested"
    assert (out.payload["step"], out.payload["attempt"]) == ("b", 0)


async def test_low_confidence_waits_for_review_with_a_deadline() -> None:
    """Below the threshold the output is recorded as pending_review with a deadline and the
    job goes to awaiting_review, emitting nothing."""
    finish = await _progress(MemoryObjects()).succeeded(
        JOB, _three_steps(review_threshold=0.9, review_deadline_seconds=5),
        StepOutput({"x": 1}, confidence=0.4), "w1")
    assert finish.status == Status.AWAITING_REVIEW
    assert finish.outbox == []
    assert finish.record is not None
    assert finish.record["state"] == "pending_review"
    assert finish.record["review_deadline_at"] is not None
    assert finish.event_detail["output"] == {"x": 1}


async def test_the_last_step_completes_with_the_artifact() -> None:
    """The last step's output becomes the artifact in the object store; job.result goes out."""
    objects = MemoryObjects()
    finish = await _progress(objects).succeeded(replace(JOB, step="c"), _three_steps(),
                                                StepOutput({"done": True}), "w1")
    assert finish.status == "completed"
    assert finish.artifact is not None
    assert json.loads(objects.data[finish.artifact["uri"]]) == {"done": True}
    assert [o.type for o in finish.outbox] == ["job.result"]


def test_a_recorded_step_is_replayed_not_run_and_feeds_the_next() -> None:
    """A recorded (done or approved) output replays the step; the next step's input is the
    previous step's recorded output; a pending review is not a result yet."""
    wf = _three_steps()
    recorded = {"a": StepRecord("a", "approved", {"fixed": 1}),
                "b": StepRecord("b", "pending_review", {"y": 2})}
    assert Progress.replay(wf.step("a"), recorded) == StepOutput({"fixed": 1})
    assert Progress.replay(wf.step("b"), recorded) is None
    assert Progress.step_input(wf, wf.step("b"), recorded) == {"fixed": 1}
    assert Progress.step_input(wf, wf.step("a"), recorded) is None
    with pytest.raises(StepFailure, match="no recorded output"):
        Progress.step_input(wf, wf.step("c"), recorded)


# -- record then call then confirm ---------------------------------------------------------


async def test_a_confirmed_side_effect_is_not_called_again() -> None:
    """once() returns the recorded answer of a confirmed effect without calling."""
    log = MemoryEffectLog()
    calls: list[str] = []

    async def call(key: str) -> dict[str, Any]:
        calls.append(key)
        return {"posting": len(calls)}

    c = ctx(step="post", effects=log)
    assert await once(c, "ledger", call) == {"posting": 1}
    assert await once(c, "ledger", call) == {"posting": 1}
    assert calls == ["job-1:post:ledger"]


async def test_an_unconfirmed_side_effect_is_called_again_with_the_same_key() -> None:
    """A crash between call and confirm: the next attempt calls again with the same key."""
    log = MemoryEffectLog()
    keys: list[str] = []

    async def crashing(key: str) -> dict[str, Any]:
        keys.append(key)
        raise RuntimeError("killed before the confirmation")

    async def call(key: str) -> dict[str, Any]:
        keys.append(key)
        return {"ok": True}

    with pytest.raises(RuntimeError):
        await once(ctx(step="post", effects=log), "ledger", crashing)
    assert await once(ctx(step="post", effects=log), "ledger", call) == {"ok": True}
    assert keys == ["job-1:post:ledger", "job-1:post:ledger"]
    assert log.records[("job-1", "job-1:post:ledger")].calls == 2


# -- the examples, step by step ------------------------------------------------------------


INVOICE_TEXT = "Vendor: ACME\nInvoice: INV-9\nTotal: EUR 12.50"


async def test_extract_text_reads_a_pdf_upload_and_keeps_the_knobs() -> None:
    """extract_text reads the text layer of an uploaded PDF; plain text input passes
    through with the fake provider's knobs."""
    objects = MemoryObjects()
    ref = await objects.put("t/in.pdf", tiny_pdf(INVOICE_TEXT.split("\n")), "application/pdf")
    out = await extract_text(ctx(objects=objects), {"text": "garbage", "input_ref": ref.uri})
    assert out.artifact == {"text": INVOICE_TEXT}
    out = await extract_text(ctx(), {"text": " hi ", "mode": "low_confidence"})
    assert out.artifact == {"text": "hi", "mode": "low_confidence"}
    with pytest.raises(StepFailure) as info:
        pdf_text(b"%PDF-1.4 broken")
    assert info.value.code == "unreadable_pdf"


async def test_extract_fields_returns_the_fields_and_the_models_confidence() -> None:
    """extract_fields asks for invoice fields and returns them with the model's confidence;
    prose instead of JSON is malformed_output."""
    fields = {"vendor": "ACME", "invoice_number": "INV-9", "total": 12.5, "currency": "EUR"}
    provider = FakeProvider(json.dumps({**fields, "confidence": 0.5}))
    out = await extract_fields(ctx(provider), {"text": INVOICE_TEXT, "mode": None})
    assert out.artifact == fields
    assert out.confidence == 0.5
    assert "invoice fields" in provider.calls[0][0]["content"].lower()
    assert "null" not in provider.calls[0][1]["content"]
    with pytest.raises(StepFailure) as info:
        await extract_fields(ctx(FakeProvider("Sure! The vendor is ACME.")), {"text": "x"})
    assert info.value.code == "malformed_output"


async def test_post_ledger_posts_once_to_a_real_ledger() -> None:
    """post_ledger sends the fields with the idempotency key; run again (a redelivery after
    the confirmation), it answers the recorded posting without a second request."""
    ledger = Ledger().start()
    try:
        post = invoice_workflow(ledger.url).step("post_ledger")
        fields = {"vendor": "ACME", "invoice_number": "INV-9", "total": 12.5, "currency": "EUR"}
        c = ctx(step="post_ledger", effects=MemoryEffectLog())
        first = await post.run(c, fields)
        again = await post.run(c, fields)
        assert first == again
        assert first.artifact["fields"] == fields
        assert ledger.requests == ["job-1:post_ledger:ledger"]
        assert len(ledger.for_job("job-1")) == 1
    finally:
        ledger.stop()


def test_chunk_text_cuts_at_boundaries_within_the_size() -> None:
    """Chunks stay within the size and prefer paragraph, then word, boundaries."""
    text = "alpha beta gamma delta epsilon zeta\n\n" + "word " * 40
    chunks = chunk_text(text, 60)
    assert chunks[0] == "alpha beta gamma delta epsilon zeta"
    assert all(len(c) <= 60 for c in chunks)
    assert all(not c.endswith(" ") for c in chunks)
    assert " ".join(chunks).split() == text.split()


async def test_embed_document_embeds_each_batch_as_a_child_and_joins_the_vectors() -> None:
    """chunk, then one embed_batch child per batch_size chunks, then their vectors joined in
    chunk order and referenced by the artifact."""
    objects = MemoryObjects()
    provider = FakeProvider()
    wf = EMBED_DOCUMENT
    chunked = await wf.step("chunk").run(ctx(provider, objects=objects),
                                         {"text": "one two three four five six seven",
                                          "chunk_chars": 50, "batch_size": 2})
    uri = chunked.artifact["chunks"]["uri"]
    objects.data[uri] = json.dumps(["a", "bb", "ccc"]).encode()
    chunked.artifact["count"] = 3
    spawned = await wf.step("embed").run(ctx(provider, objects=objects), chunked.artifact)
    assert spawned.spawn is not None
    assert spawned.spawn.workflow == EMBED_BATCH.name
    assert spawned.spawn.inputs == ({"chunks": uri, "start": 0, "stop": 2},
                                    {"chunks": uri, "start": 2, "stop": 3})
    assert provider.embedded == []  # the children embed, each its own batch
    children = []
    for index, batch in enumerate(reversed(spawned.spawn.inputs)):  # finish in any order
        out = await EMBED_BATCH.steps[0].run(ctx(provider, objects=objects), dict(batch))
        ref = await objects.put(f"t/artifacts/{index}.json", json.dumps(out.artifact).encode(),
                                "application/json")
        children.append({"index": 1 - index, "artifact": ref.as_dict()})
    assert provider.embedded == [["ccc"], ["a", "bb"]]
    joined = {**spawned.artifact, "children": sorted(children, key=lambda c: c["index"])}
    out = await wf.step("vectors").run(ctx(provider, objects=objects), joined)
    assert (out.artifact["chunks"], out.artifact["batches"], out.artifact["dimensions"]) == (
        3, 2, 2)
    vectors = json.loads(objects.data[out.artifact["vectors"]["uri"]])
    assert [v["vector"][0] for v in vectors] == [1.0, 2.0, 3.0]
