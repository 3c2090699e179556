"""The OpenAPI 3.1 document served at /openapi.json, generated from the models and routes.

Schemas come from producers.models (``model_json_schema``, every ``$defs`` entry hoisted
into ``components/schemas``); paths and operations come from the route table, so a route
cannot be served undocumented. A submit's ``input`` is documented per workflow: the JSON
body is a ``oneOf`` of one variant per registered workflow, discriminated by ``workflow``,
whose ``input`` is that workflow's own input model.

``info.version`` is calmq's own version, so a client generated from the document (or the
copy committed as docs/reference/openapi.json by ``calmq openapi``) says which release it
describes.
"""

from __future__ import annotations

import copy
import functools
import operator
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, create_model

from calmq import __version__
from calmq.jobs import Priority
from calmq.producers import models
from calmq.producers.models import SubmitRequest
from calmq.producers.routing import COMPONENTS, Route
from calmq.workflows import Workflow

__all__ = ["document"]

# Every public model of producers.models is a component a route may reference with
# routing.ref(); SubmitRequest is generated per workflow instead (see _submit_body).
_DOCUMENTED: tuple[type[BaseModel], ...] = tuple(
    m for m in (getattr(models, name) for name in models.__all__)
    if isinstance(m, type) and issubclass(m, BaseModel) and m is not SubmitRequest)


def document(routes: Iterable[Route], workflows: Mapping[str, Workflow]) -> dict[str, Any]:
    """The whole document for these routes and these workflows (a fresh, JSON-ready dict)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = copy.deepcopy(route.operation)
    return {
        "openapi": "3.1.0",
        "info": {"title": "calmq", "version": __version__,
                 "description": "Intake API of calmq; see docs/reference/api.md."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": _schemas(workflows),
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }


def _schemas(workflows: Mapping[str, Workflow]) -> dict[str, Any]:
    # One generation pass over every model, so a name two models share (two workflows'
    # ``Input``) is disambiguated by pydantic instead of overwritten here.
    fields: dict[str, Any] = {m.__name__: (m, ...) for m in _DOCUMENTED}
    fields["SubmitRequest"] = (_submit_body(workflows), ...)
    holder = create_model("OpenApiSchemas", **fields)
    generated = holder.model_json_schema(ref_template=COMPONENTS + "{model}")
    schemas: dict[str, Any] = generated.get("$defs", {})
    submit = dict(generated["properties"]["SubmitRequest"])
    submit.pop("title", None)
    schemas["SubmitRequest"] = submit
    schemas["SubmitForm"] = _submit_form(workflows)
    return dict(sorted(schemas.items()))


def _submit_body(workflows: Mapping[str, Workflow]) -> Any:
    """The type of a JSON submit: one SubmitRequest variant per workflow."""
    variants = [_submit_variant(wf) for _name, wf in sorted(workflows.items())]
    if not variants:
        return SubmitRequest
    if len(variants) == 1:
        return variants[0]
    return Annotated[functools.reduce(operator.or_, variants), Field(discriminator="workflow")]


def _submit_variant(workflow: Workflow) -> type[SubmitRequest]:
    # Built at run time from the registry, which mypy cannot see: the field types are Any.
    name: Any = Literal.__getitem__(workflow.name)
    input_type: Any = workflow.input_model | None
    camel = "".join(p.capitalize() for p in re.split(r"[^0-9A-Za-z]+", workflow.name) if p)
    variant: type[SubmitRequest] = create_model(
        f"Submit{camel}",
        __base__=SubmitRequest,
        __doc__=f"POST /v1/jobs for workflow {workflow.name} (version {workflow.version}).",
        workflow=(name, ...),
        input=(input_type, None),
    )
    return variant


def _submit_form(workflows: Mapping[str, Workflow]) -> dict[str, Any]:
    """The multipart submit: the file is the input; other fields are text (JSON for metadata)."""
    names = sorted(workflows)
    workflow: dict[str, Any] = {"type": "string", "enum": names} if names else {"type": "string"}
    return {"type": "object", "required": ["workflow", "file"], "properties": {
        "workflow": workflow, "file": {"type": "string", "format": "binary"},
        "priority": {"type": "string", "enum": [p.value for p in Priority]},
        "deadline_seconds": {"type": "string", "description": "an integer"},
        "callback_url": {"type": "string"},
        "metadata": {"type": "string", "description": "a JSON object"}}}
