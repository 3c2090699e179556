"""Structured outputs the real APIs accept, derived from a step's output model's schema.

A step hands the gateway its output model's plain JSON schema (pydantic's
``model_json_schema()``); each provider needs its own dialect of it:

- OpenAI, strict mode (``response_format.json_schema.strict = true``): every object gets
  ``additionalProperties: false`` and lists every property in ``required``; a property that
  was optional becomes nullable (``anyOf [..., {"type": "null"}]``) and loses its
  ``default``; keywords strict mode does not support (``minLength``, ``maxLength``, ...) are
  taken out and written into the description, where the model still reads them; ``$ref``
  siblings are unravelled; the name matches ``^[a-zA-Z0-9_-]{1,64}$``.
- Anthropic (``output_config.format``): every object gets ``additionalProperties: false``;
  numeric and length constraints, which it does not support, go into the description.

The answer is always validated against the step's own model afterwards (``read_answer``):
the provider's constraint is a help, not the check. A property the strict schema made
nullable and the model answered ``null`` is read as absent, so the model's default applies.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Final, TypeVar

from pydantic import BaseModel

from calmq.storable import loads

__all__ = ["anthropic_schema", "openai_schema_name", "openai_strict_schema", "read_answer"]

_NAME_BAD: Final = re.compile(r"[^a-zA-Z0-9_-]")
# What OpenAI's strict mode supports besides structure (Structured Outputs guide).
_OPENAI_KEEP: Final = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "anyOf", "enum",
    "const", "$ref", "$defs", "definitions", "description", "title", "pattern", "format",
    "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "minItems",
    "maxItems"})
_OPENAI_FORMATS: Final = frozenset({"date-time", "time", "date", "duration", "email",
                                    "hostname", "ipv4", "ipv6", "uuid"})
# What Anthropic's structured outputs support.
_ANTHROPIC_KEEP: Final = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "anyOf", "allOf",
    "enum", "const", "$ref", "$defs", "definitions", "description", "title", "format",
    "default", "pattern", "minItems"})
_ANTHROPIC_FORMATS: Final = _OPENAI_FORMATS | {"uri"}

M = TypeVar("M", bound=BaseModel)


def openai_schema_name(schema: dict[str, Any]) -> str:
    """The schema's title as OpenAI takes a name (``^[a-zA-Z0-9_-]{1,64}$``)."""
    title = schema.get("title")
    name = _NAME_BAD.sub("_", title)[:64] if isinstance(title, str) and title else "output"
    return name or "output"


def _with_note(node: dict[str, Any], dropped: dict[str, Any]) -> None:
    """Write the keywords a provider does not take into the description (as the SDKs'
    own helpers do): the model still reads them; the step's model still checks them."""
    if not dropped:
        return
    note = "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in dropped.items()) + "}"
    described = node.get("description")
    node["description"] = f"{described}\n\n{note}" if described else note


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    node: Any = root
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return dict(node)


def openai_strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` in OpenAI's strict dialect (a new dict; ``schema`` is not changed)."""
    root = copy.deepcopy(schema)
    return _openai_node(root, root, nullable=False)


def _openai_node(node: dict[str, Any], root: dict[str, Any], *, nullable: bool
                 ) -> dict[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str) and len(node) > 1:
        # A $ref with siblings (a description, a default): OpenAI takes a bare $ref only.
        node = {**_resolve(root, ref), **{k: v for k, v in node.items() if k != "$ref"}}
    out: dict[str, Any] = {}
    dropped: dict[str, Any] = {}
    for key, value in node.items():
        if key == "default":
            continue  # strict mode fills every property; a default says nothing more
        if key == "format" and value not in _OPENAI_FORMATS:
            dropped[key] = value
        elif key in _OPENAI_KEEP:
            out[key] = value
        else:
            dropped[key] = value
    for defs_key in ("$defs", "definitions"):
        if isinstance(out.get(defs_key), dict):
            out[defs_key] = {name: _openai_node(sub, root, nullable=False)
                             for name, sub in out[defs_key].items()}
    if out.get("type") == "object" or isinstance(out.get("properties"), dict):
        properties = out.get("properties") or {}
        required = set(out.get("required") or [])
        out["properties"] = {
            key: _openai_node(sub, root, nullable=key not in required)
            for key, sub in properties.items()}
        out["required"] = list(properties)
        out["additionalProperties"] = False
        out.setdefault("type", "object")
    if isinstance(out.get("items"), dict):
        out["items"] = _openai_node(out["items"], root, nullable=False)
    if isinstance(out.get("anyOf"), list):
        out["anyOf"] = [_openai_node(sub, root, nullable=False) for sub in out["anyOf"]]
    _with_note(out, dropped)
    if nullable and not _allows_null(out):
        meta: dict[str, Any] = {k: out.pop(k) for k in ("description", "title") if k in out}
        out = {"anyOf": [out, {"type": "null"}], **meta}
    return out


def _allows_null(node: dict[str, Any]) -> bool:
    kinds = node.get("type")
    if kinds == "null" or (isinstance(kinds, list) and "null" in kinds):
        return True
    return any(isinstance(s, dict) and s.get("type") == "null"
               for s in node.get("anyOf") or [])


def anthropic_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` in the dialect of Anthropic's ``output_config.format`` (a new dict)."""
    return _anthropic_node(copy.deepcopy(schema))


def _anthropic_node(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dropped: dict[str, Any] = {}
    for key, value in node.items():
        unsupported = ((key == "format" and value not in _ANTHROPIC_FORMATS)
                       or (key == "minItems" and value not in (0, 1)))
        if unsupported:
            dropped[key] = value
        elif key in _ANTHROPIC_KEEP:
            out[key] = value
        else:
            dropped[key] = value
    for defs_key in ("$defs", "definitions"):
        if isinstance(out.get(defs_key), dict):
            out[defs_key] = {n: _anthropic_node(s) for n, s in out[defs_key].items()}
    if out.get("type") == "object" or isinstance(out.get("properties"), dict):
        out["properties"] = {k: _anthropic_node(s)
                             for k, s in (out.get("properties") or {}).items()}
        out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = _anthropic_node(out["items"])
    for key in ("anyOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_anthropic_node(s) for s in out[key]]
    _with_note(out, dropped)
    return out


def read_answer(model: type[M], content: str) -> M:
    """The model's answer validated against the step's own output model.

    ``null`` for a property the model does not require (a strict schema made it nullable)
    is read as absent, so the model's default applies. Raises pydantic's ValidationError
    (or ValueError for text that is not JSON, or JSON with a number that is not finite:
    ``1e999`` would pass a float field as infinity, and no row could hold the outcome)."""
    data = loads(content)
    if isinstance(data, dict):
        required = {name for name, f in model.model_fields.items() if f.is_required()}
        data = {k: v for k, v in data.items() if v is not None or k in required}
    return model.model_validate(data)
