"""The API's models, views and generated OpenAPI document agree, and the client stays light."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from calmq.data import HistoryEvent, JobDetail
from calmq.data.deadletters import DeadLetter as DeadLetterRow
from calmq.data.reviews import PendingReview
from calmq.errors import ContractError
from calmq.producers.models import DeadLetter, JobView, ReviewItem
from calmq.producers.openapi import document
from calmq.producers.routes import ROUTES
from calmq.producers.timestamps import format_time, parse_time
from calmq.producers.views import dead_letter_item, job_view, review_item
from calmq.workflows import builtin_workflows

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _job_row() -> dict[str, Any]:
    return {"id": uuid.uuid4(), "workflow": "summarize", "status": "completed", "attempt": 1,
            "step": "summarize", "created_at": AT, "updated_at": AT,
            "artifact": {"uri": "file:///x", "sha256": "ab", "content_type": "application/json",
                         "size": 3},
            "error": {"code": "model_refusal", "class": "policy", "message": "no"},
            "input_tokens": 5, "output_tokens": None, "cost_usd": 0.25,
            "events": [{"type": "queued", "at": AT, "attempt": 0, "detail": {}}]}


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def test_views_fit_their_response_models() -> None:
    """The dicts the routes answer with validate against the documented response models."""
    row = _job_row()
    detail = JobDetail(**{k: v for k, v in row.items() if k != "events"},
                       events=[HistoryEvent(id=1, **e) for e in row["events"]])
    view = JobView.model_validate(job_view(detail))
    assert view.usage.output_tokens == 0
    assert view.error is not None
    assert view.error.failure_class == "policy"
    assert json.loads(view.model_dump_json(by_alias=True))["error"]["class"] == "policy"
    ReviewItem.model_validate(review_item(PendingReview(
        row["id"], row["workflow"], row["step"], review_deadline_at=None, updated_at=AT,
        created_at=AT, output={"summary": ""}, confidence=0.5)))
    DeadLetter.model_validate(dead_letter_item(DeadLetterRow(
        row["id"], uuid.uuid4(), "t", row["workflow"], 1, "bulk", "default", row["step"],
        row["attempt"], row["error"], created_at=AT, dead_lettered_at=AT)))


def test_every_reference_of_the_document_resolves() -> None:
    """Each $ref of the generated document names a schema under components/schemas."""
    doc = document(ROUTES, builtin_workflows())
    names = set(doc["components"]["schemas"])
    missing = {r for r in _refs(doc) if r.removeprefix("#/components/schemas/") not in names}
    assert missing == set()


def test_submit_body_documents_each_workflows_input() -> None:
    """The JSON submit is one variant per workflow, its input that workflow's input model."""
    workflows = builtin_workflows()
    schemas = document(ROUTES, workflows)["components"]["schemas"]
    mapping = schemas["SubmitRequest"]["discriminator"]["mapping"]
    assert set(mapping) == set(workflows)
    for name, target in mapping.items():
        variant = schemas[target.removeprefix("#/components/schemas/")]
        assert variant["properties"]["workflow"]["const"] == name
        model = workflows[name].input_model.__name__
        assert {"$ref": f"#/components/schemas/{model}"} in variant["properties"]["input"]["anyOf"]
    assert schemas["SubmitForm"]["properties"]["workflow"]["enum"] == sorted(workflows)


def test_one_time_format_round_trips_and_bad_times_are_refused() -> None:
    """parse_time reads what format_time writes; no zone or no time is the named error."""
    assert parse_time("t", format_time(AT)) == AT
    assert parse_time("t", None) is None
    with pytest.raises(ContractError) as zoneless:
        parse_time("t", "2026-01-01T00:00:00")
    assert (zoneless.value.code, zoneless.value.status) == ("invalid_query", 400)
    with pytest.raises(ContractError) as bad:
        parse_time("since", "yesterday", zone_required=False, status=422)
    assert (bad.value.code, bad.value.status) == ("invalid_query", 422)


def test_importing_the_client_loads_no_server_module() -> None:
    """import calmq.producers.client loads neither aiohttp.web, the review desk nor a route."""
    probe = ("import sys, calmq.producers.client; print(sorted(m for m in sys.modules if "
             "m.startswith(('aiohttp.web', 'calmq.reviews', 'calmq.producers.routes', "
             "'calmq.producers.api'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("key", ["", " lead", "trail ", "tab\there", "nul\x00", "x" * 201])
def test_a_concurrency_key_the_api_refuses_the_client_refuses_too(key: str) -> None:
    """The API's body model and the client library's enqueue (which writes rows directly)
    refuse the same keys, with the same code."""
    from pydantic import ValidationError

    from calmq.limits import check_concurrency_key
    from calmq.producers.models import SubmitRequest

    with pytest.raises(ValidationError):
        SubmitRequest.model_validate({"workflow": "summarize", "concurrency_key": key})
    with pytest.raises(ContractError) as refused:
        check_concurrency_key(key)
    assert refused.value.code == "invalid_body"


@pytest.mark.parametrize("key", ["customer-4711", "a", "Müller GmbH", "x" * 200])
def test_a_concurrency_key_both_accept(key: str) -> None:
    from calmq.limits import check_concurrency_key
    from calmq.producers.models import SubmitRequest

    assert SubmitRequest.model_validate({"workflow": "summarize",
                                         "concurrency_key": key}).concurrency_key == key
    check_concurrency_key(key)
