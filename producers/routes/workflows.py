"""The workflows a job may name, with their input and output schemas (any tenant's key)."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel

from calmq.errors import NotFound
from calmq.producers.auth import tenant
from calmq.producers.context import WORKFLOWS
from calmq.producers.models import ByReferenceInfo, WorkflowInfo, WorkflowList, WorkflowStep
from calmq.producers.routing import Route, answer, problems
from calmq.workflows import Workflow

__all__ = ["ROUTES"]


def _schema(model: type[BaseModel] | None) -> dict[str, Any] | None:
    return None if model is None else model.model_json_schema()


def workflow_info(workflow: Workflow) -> WorkflowInfo:
    """A registered workflow as GET /v1/workflows describes it (schemas from its models)."""
    return WorkflowInfo(
        name=workflow.name, version=workflow.version, pool=workflow.pool,
        input_schema=workflow.input_model.model_json_schema(),
        output_schema=_schema(workflow.steps[-1].output_model),
        review_threshold=workflow.review_threshold,
        steps=[WorkflowStep(name=s.name, pool=workflow.pool_of(s),
                            timeout_seconds=s.timeout_seconds, max_attempts=s.attempts,
                            output_schema=_schema(s.output_model))
               for s in workflow.steps],
        by_reference=None if workflow.by_reference is None else ByReferenceInfo(
            content_types=sorted(workflow.by_reference.content_types),
            max_bytes=workflow.by_reference.max_bytes))


async def list_workflows(request: web.Request) -> web.Response:
    await tenant(request)
    registry = request.app[WORKFLOWS]
    body = WorkflowList(workflows=[workflow_info(registry[n]) for n in sorted(registry)])
    return web.json_response(body.model_dump(mode="json"))


async def get_workflow(request: web.Request) -> web.Response:
    await tenant(request)
    name = request.match_info["name"]
    workflow = request.app[WORKFLOWS].get(name)
    if workflow is None:
        raise NotFound(f"no workflow {name!r}: GET /v1/workflows lists them",
                       code="unknown_workflow")
    return web.json_response(workflow_info(workflow).model_dump(mode="json"))


_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}

ROUTES = [
    Route("GET", "/v1/workflows", list_workflows, {
        "operationId": "listWorkflows",
        "responses": {"200": answer("the workflows, by name", WorkflowList),
                      **problems(401, 429)}}),
    Route("GET", "/v1/workflows/{name}", get_workflow, {
        "operationId": "getWorkflow", "parameters": [_NAME],
        "responses": {"200": answer("one workflow", WorkflowInfo), **problems(401, 404, 429)}}),
]
