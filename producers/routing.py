"""A route of the API: method, path, handler and its OpenAPI operation, declared together.

Each route module lists its ``ROUTES``; producers.routes joins them into the table
build_app registers and producers.openapi documents, so a route cannot exist without its
documentation. Schemas are referenced by name (``ref``) and generated from
producers.models by producers.openapi.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from calmq.producers.parsing import LIST_MAX

__all__ = ["COMPONENTS", "JOB_ID", "JSON", "LIMIT", "PUBLIC", "Handler", "Route", "answer",
           "json_body", "problems", "query", "ref"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

JSON = "application/json"
COMPONENTS = "#/components/schemas/"


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    handler: Handler
    operation: dict[str, Any]  # the OpenAPI operation object of this method and path


def ref(schema: type[BaseModel] | str) -> dict[str, str]:
    """A reference to a schema of components/schemas, by model or by generated name."""
    name = schema if isinstance(schema, str) else schema.__name__
    return {"$ref": COMPONENTS + name}


def answer(description: str, schema: type[BaseModel] | str | None = None,
           content_type: str = JSON) -> dict[str, Any]:
    if schema is None:
        return {"description": description}
    return {"description": description, "content": {content_type: {"schema": ref(schema)}}}


def problems(*statuses: int) -> dict[str, Any]:
    """The documented error answers: each a problem+json body."""
    return {str(s): answer("problem", "Problem", "application/problem+json") for s in statuses}


def json_body(schema: type[BaseModel] | str) -> dict[str, Any]:
    return {"required": True, "content": {JSON: {"schema": ref(schema)}}}


def query(name: str, schema: dict[str, Any], description: str | None = None
          ) -> dict[str, Any]:
    param: dict[str, Any] = {"name": name, "in": "query", "required": False, "schema": schema}
    if description is not None:
        param["description"] = description
    return param


JOB_ID: dict[str, Any] = {"name": "job_id", "in": "path", "required": True,
                          "schema": {"type": "string", "format": "uuid"}}
LIMIT = query("limit", {"type": "integer", "minimum": 1, "maximum": LIST_MAX})
# Operations anyone may call: no bearer key.
PUBLIC: dict[str, Any] = {"security": []}
