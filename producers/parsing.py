"""Reading what a request sends: a JSON body into its model, the job id, a list's limit.

Every route with a body reads it through ``read_body`` (or, for a multipart submit, hands
the form's fields to ``validate``), so every body error is the same problem+json: 415
``unsupported_media_type``, 400 ``invalid_json``, 422 ``invalid_body``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from calmq.errors import ContractError, NotFound

__all__ = ["LIST_MAX", "job_id", "limit", "read_body", "validate"]

LIST_MAX = 200

M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], body: Any) -> M:
    """``body`` as ``model``; ContractError 422 invalid_body naming each failing field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise ContractError(detail, code="invalid_body", status=422) from exc


async def read_body(request: web.Request, model: type[M]) -> tuple[M, bytes]:
    """The JSON object body validated into ``model``, and its raw bytes (for hashing)."""
    if request.content_type != "application/json":
        raise ContractError(
            f"send application/json or multipart/form-data, not {request.content_type!r}",
            code="unsupported_media_type", status=415,
        )
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ContractError(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise ContractError("the body must be a JSON object", code="invalid_body", status=422)
    return validate(model, body), raw


def job_id(request: web.Request) -> uuid.UUID:
    """The ``{job_id}`` of the path; a malformed one is as unknown as a missing job (404)."""
    try:
        return uuid.UUID(request.match_info["job_id"])
    except ValueError:
        raise NotFound("no such job") from None


def limit(query: Mapping[str, str], *, default: int) -> int:
    """The ``limit`` of a list endpoint: 1 to LIST_MAX, else 400 invalid_query."""
    try:
        value = int(query.get("limit", str(default)))
    except ValueError:
        value = 0
    if not 1 <= value <= LIST_MAX:
        raise ContractError(f"limit is an integer from 1 to {LIST_MAX}", code="invalid_query")
    return value
