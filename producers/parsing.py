"""Reading what a request sends: a JSON body into its model, the job id, a list's limit.

Every route with a body reads it through ``read_body`` (or, for a multipart submit, hands
the form's fields to ``validate``), so every body error is the same problem+json: 415
``unsupported_media_type``, 400 ``invalid_json``, 422 ``invalid_body``.

Bad input is a 4xx here, before it can reach PostgreSQL as a 5xx: JSON nested deeper than
the parser allows and the non-JSON constants ``NaN``/``Infinity`` (jsonb refuses them) are
``invalid_json``; a number past a double's range (``1e999``, which Python's parser reads as
infinity, and jsonb refuses too) is 400 ``non_finite_number``; a NUL character or a lone
surrogate in any string of a body (jsonb and text columns refuse both) is 400
``unstorable_text``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from calmq.errors import ContractError, NotFound
from calmq.storable import storable

__all__ = ["LIST_MAX", "check_storable", "job_id", "limit", "parse_json", "read_body", "storable",
           "validate"]

LIST_MAX = 200

M = TypeVar("M", bound=BaseModel)


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ContractError(
            f"the number {text[:40]} is beyond the range of a double-precision number, which "
            "is the most this API stores", code="non_finite_number")
    return value


def parse_json(raw: str | bytes, where: str = "the body") -> Any:
    """``raw`` parsed: 400 ``invalid_json`` for what is not JSON (or holds NaN/Infinity, or
    is nested too deep), 400 ``non_finite_number`` for a number past a double's range."""
    try:
        return json.loads(raw, parse_constant=_constant, parse_float=_finite)
    except ValueError as exc:
        raise ContractError(f"{where} is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise ContractError(f"{where} is nested deeper than this API parses",
                            code="invalid_json") from exc


def check_storable(value: Any, where: str = "the body") -> None:
    """Raise 400 unstorable_text if any string (key or value) of ``value`` cannot be stored.

    Iterative: a body may be nested as deep as the JSON parser allows, deeper than a
    recursive walk could go.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item)  # JSON keys are strings too
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, str) and not storable(item):
            raise ContractError(
                f"{where} holds text that cannot be stored: a NUL character (\\u0000) or "
                "a lone surrogate", code="unstorable_text")


def validate(model: type[M], body: Any, *, text_checked: bool = False) -> M:
    """``body`` as ``model``; ContractError 422 invalid_body naming each failing field, 400
    unstorable_text for a string that cannot be stored (``text_checked``: the caller showed
    there is none, as a bulk submit does for its whole body at once)."""
    if not text_checked:
        check_storable(body)
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
    body = parse_json(raw)
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
