"""Reading the console's forms and query strings: what a person typed, checked before it
reaches PostgreSQL.

PostgreSQL stores no NUL character (U+0000) in text or jsonb, and no lone surrogate is
valid UTF-8: a field holding one would fail deep in a query with a 500. Each field read
here is refused first with ``invalid_form`` (422) naming the field, so the page says what
to fix and nothing is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from calmq.errors import ContractError

__all__ = ["checked", "optional", "storable_problem", "text"]


def storable_problem(value: Any) -> str | None:
    """Why ``value`` (text, or JSON made of dicts, lists and text) cannot be stored; None
    when it can."""
    if isinstance(value, str):
        if "\x00" in value:
            return "contains a NUL character (U+0000), which cannot be stored"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "is not valid Unicode text (a lone surrogate)"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            problem = storable_problem(k) or storable_problem(v)
            if problem:
                return problem
        return None
    if isinstance(value, list):
        return next((p for p in map(storable_problem, value) if p), None)
    return None


def checked(name: str, value: Any) -> Any:
    """``value``, or ContractError invalid_form when it cannot be stored."""
    problem = storable_problem(value)
    if problem:
        raise ContractError(f"{name} {problem}", code="invalid_form", status=422)
    return value


def text(fields: Mapping[str, Any], name: str, *, label: str | None = None) -> str:
    """A field's text, stripped ("" when absent)."""
    return str(checked(label or name, str(fields.get(name, "")))).strip()


def optional(fields: Mapping[str, Any], name: str, *, label: str | None = None) -> str | None:
    """A field's text, stripped; None when absent or blank."""
    return text(fields, name, label=label) or None
