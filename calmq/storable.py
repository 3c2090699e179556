"""Storable text: what PostgreSQL would refuse, found before a group commit meets it.

PostgreSQL's ``text`` and ``jsonb`` cannot hold the NUL character (``\\u0000``), and its
UTF-8 cannot hold a lone surrogate (``\\ud800``, e.g. from bytes decoded with
``surrogateescape``, or an unpaired escape in a model's JSON). A step's output, its error
message and the details of its history event come from outside (an uploaded file, the
model): one such value in a worker's group commit failed the whole group's transaction, and
the committer wrote it again forever, with up to 250 outcomes of any tenants in it.

``unstorable(value)`` says where such a character is (None: storable); the worker and the
batch poller check every outcome with ``unstorable_outcome`` before it is committed and fail
the step instead (class ``input``, code ``unstorable_output``, a message that names the
place and holds none of the text). ``refused`` tells a database error that is the data's
fault from one of the database itself, for the committer's split (calmq.group_commit).

jsonb cannot hold a number that is not finite either, and Python's JSON parser makes one
of ``1e999`` (infinity) without complaint: ``loads`` is the parser for JSON from outside
(a request body, a model's answer) that refuses it with ``NonFiniteNumber`` (a
ValueError), and ``unstorable`` names one found in a value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import psycopg

if TYPE_CHECKING:
    from calmq.data.attempts import Finish

__all__ = ["UNSTORABLE_OUTPUT", "NonFiniteNumber", "clean", "loads", "non_finite", "refused",
           "storable", "unstorable", "unstorable_outcome"]

UNSTORABLE_OUTPUT = "unstorable_output"
_REPLACEMENT = "\ufffd"
_MAX_DEPTH = 200  # deeper than any JSON PostgreSQL parses in a default configuration


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "a NUL character"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "a lone surrogate (not valid UTF-8)"
    return None


class NonFiniteNumber(ValueError):
    """JSON holds a number past a float's range (``1e999``) or ``NaN``/``Infinity``."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(f"the number {text[:40]} is beyond the range of a "
                              "double-precision number")
    return value


def _constant(name: str) -> Any:
    raise NonFiniteNumber(f"{name} is not a JSON number")


def loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses a number that is not finite (``NonFiniteNumber``; other
    errors as json.loads raises them)."""
    return json.loads(text, parse_float=_finite, parse_constant=_constant)


def non_finite(value: Any, where: str = "value") -> str | None:
    """Where ``value`` (JSON-like) holds a number that is not finite, e.g.
    ``"output.score"``; None if it holds none. Iterative: any depth."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return at
        if isinstance(item, Mapping):
            stack.extend((v, f"{at}.{_label(str(k))}") for k, v in item.items())
        elif isinstance(item, list | tuple):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
    return None


def storable(text: str) -> bool:
    """Whether PostgreSQL can store ``text``: no NUL, and valid UTF-8 (no lone surrogate).
    The one check of text, for the API's bodies and query strings (calmq.producers.parsing)
    as for a worker's outcomes."""
    return _text_problem(text) is None


def unstorable(value: Any, where: str = "value") -> str | None:
    """Where ``value`` (JSON-like: dicts, lists, strings, numbers) holds text or a number
    PostgreSQL refuses, e.g. ``"a NUL character in output.summary"``; None if none."""
    return _walk(value, where, 0)


def _walk(value: Any, where: str, depth: int) -> str | None:
    if isinstance(value, str):
        found = _text_problem(value)
        return None if found is None else f"{found} in {where}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"a number that is not finite in {where}"
    if depth > _MAX_DEPTH:
        return f"nesting deeper than {_MAX_DEPTH} levels in {where}"
    if isinstance(value, Mapping):
        for key, item in value.items():
            name = key if isinstance(key, str) else str(key)
            found = _text_problem(name)
            if found is not None:
                return f"{found} in a key of {where}"
            deeper = _walk(item, f"{where}.{_label(name)}", depth + 1)
            if deeper is not None:
                return deeper
        return None
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            deeper = _walk(item, f"{where}[{index}]", depth + 1)
            if deeper is not None:
                return deeper
    return None


def _label(name: str) -> str:
    """A key as a message may show it: short, and itself storable (it was checked)."""
    return name if len(name) <= 40 else name[:37] + "..."


def clean(text: str) -> str:
    """``text`` with every character PostgreSQL refuses replaced by U+FFFD."""
    if _text_problem(text) is None:
        return text
    # A lone surrogate is one code point of its own in a str (a valid pair is not).
    return "".join(_REPLACEMENT if c == "\x00" or "\ud800" <= c <= "\udfff" else c
                   for c in text)


def unstorable_outcome(finish: Finish) -> str | None:
    """Where an attempt's outcome holds text PostgreSQL refuses (None: it can be committed):
    its event detail, error, artifact reference, recorded step output and outbox events."""
    parts: Iterable[tuple[str, Any]] = (
        ("event detail", finish.event_detail),
        ("error", finish.error),
        ("artifact", finish.artifact),
        ("output", (finish.record or {}).get("output")),
        *((f"{entry.type} event", (entry.payload, entry.headers)) for entry in finish.outbox),
    )
    for where, value in parts:
        found = unstorable(value, where)
        if found is not None:
            return found
    return None


def refused(exc: BaseException) -> bool:
    """Whether the database refused a write because of the data it was given (so writing
    the same data again fails again): a data exception (SQLSTATE class 22: a NUL, bad
    UTF-8, a number out of range), a program limit (class 54: a value too large), or text
    the driver could not encode. Integrity and connection errors are not: a missing row
    or a lost server is not cured by splitting a group."""
    return isinstance(exc, UnicodeError | psycopg.DataError
                      | psycopg.errors.ProgramLimitExceeded)
