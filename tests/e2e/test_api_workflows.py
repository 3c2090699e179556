"""GET /v1/workflows: what a client may submit, with schemas a validator can use."""

from __future__ import annotations

import uuid

import pytest
from pydantic import TypeAdapter, ValidationError

from calmq.tooling.devstack import StackState
from calmq.workflows import builtin_workflows
from tests.support.api import Api, create_tenant

pytestmark = pytest.mark.e2e


def _api(stack: StackState, key: str | None = None) -> Api:
    return Api(stack.env["CALMQ_API_URL"], key or create_tenant(
        stack.env["CALMQ_DATABASE_URL"], f"wf-{uuid.uuid4().hex[:8]}"))


def test_workflows_list_names_each_with_its_input_and_output_schema(stack: StackState) -> None:
    """Every built-in workflow is listed with its version, steps, pools and JSON Schemas that
    are its models' own (an input the schema refuses, the API refuses too)."""
    api = _api(stack)
    status, _h, body = api.call("GET", "/v1/workflows")
    assert status == 200
    listed = {w["name"]: w for w in body["workflows"]}
    builtin = builtin_workflows()
    assert set(builtin) <= set(listed)
    for name, workflow in builtin.items():
        info = listed[name]
        assert info["version"] == workflow.version
        assert info["input_schema"] == workflow.input_model.model_json_schema()
        assert [s["name"] for s in info["steps"]] == [s.name for s in workflow.steps]
        assert [s["pool"] for s in info["steps"]] == [workflow.pool_of(s) for s in workflow.steps]
        last = workflow.steps[-1].output_model
        assert info["output_schema"] == (last.model_json_schema() if last else None)
    # The summarize input schema requires what the API requires.
    schema = listed["summarize"]["input_schema"]
    assert "text" in schema["properties"]
    with pytest.raises(ValidationError):
        TypeAdapter(builtin["summarize"].input_model).validate_python({"text": 5})
    status, _h, problem = api.call("POST", "/v1/jobs", {"workflow": "summarize",
                                                        "input": {"text": 5}})
    assert (status, problem["code"]) == (422, "invalid_input")


def test_one_workflow_and_an_unknown_one(stack: StackState) -> None:
    """GET /v1/workflows/{name} answers one workflow; an unknown name is 404 unknown_workflow."""
    api = _api(stack)
    status, _h, body = api.call("GET", "/v1/workflows/summarize")
    assert (status, body["name"]) == (200, "summarize")
    status, _h, problem = api.call("GET", "/v1/workflows/no-such-workflow")
    assert (status, problem["code"]) == (404, "unknown_workflow")


def test_workflows_need_an_api_key(stack: StackState) -> None:
    """Like every /v1 route, the list needs a key: 401 without one."""
    status, _h, problem = _api(stack, key="not-a-key").call("GET", "/v1/workflows")
    assert (status, problem["code"]) == (401, "invalid_api_key")
