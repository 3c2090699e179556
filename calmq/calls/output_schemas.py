"""Structured outputs: what every provider's dialect shares, and the reading of the answer.

A step hands the gateway its output model's plain JSON schema (pydantic's
``model_json_schema()``); each provider's wire derives its own dialect of it, in its module
(calmq.calls.wires.openai: OpenAI's strict mode; calmq.calls.wires.anthropic: Anthropic's
``output_config.format``). A keyword a dialect does not take is written into the
description (``with_note``), where the model still reads it.

The answer is always validated against the step's own model afterwards (``read_answer``):
the provider's constraint is a help, not the check. A property the strict schema made
nullable and the model answered ``null`` is read as absent, so the model's default applies.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel

from calmq.storable import loads

__all__ = ["read_answer", "with_note"]

M = TypeVar("M", bound=BaseModel)


def with_note(node: dict[str, Any], dropped: dict[str, Any]) -> None:
    """Write the keywords a provider does not take into the description (as the SDKs'
    own helpers do): the model still reads them; the step's model still checks them."""
    if not dropped:
        return
    note = "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in dropped.items()) + "}"
    described = node.get("description")
    node["description"] = f"{described}\n\n{note}" if described else note


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
