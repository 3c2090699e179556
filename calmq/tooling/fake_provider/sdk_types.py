"""A request body checked against the official SDKs' request types (``TypedDict``s).

The ``openai`` and ``anthropic`` packages describe every request parameter as a
``TypedDict`` (required and optional keys, ``Literal`` values, nested unions). This module
walks a JSON body against such a type and names every key the type does not have, every
required key that is missing and every value of the wrong type, so the fake provider (and
the conformance test) refuse what the SDK's own types would not build. Pydantic is not used
for this: it ignores unknown ``TypedDict`` keys and validates ``Iterable`` fields lazily.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin

import typing_extensions

__all__ = ["SdkMissing", "check", "sdk_available"]

_NONE = type(None)
class _T(typing.TypedDict):
    pass


class _U(typing_extensions.TypedDict):
    pass


_TYPED_DICT_META = (type(_T), type(_U))


class SdkMissing(RuntimeError):
    """The official SDKs are not installed (``pip install 'calmq[fake]'``)."""


def sdk_available() -> bool:
    try:
        import anthropic  # noqa: F401
        import openai  # noqa: F401
    except ImportError:
        return False
    return True


def _is_typed_dict(tp: Any) -> bool:
    return isinstance(tp, _TYPED_DICT_META) and hasattr(tp, "__required_keys__")


def _strip(tp: Any) -> Any:
    """``Required[X]``, ``NotRequired[X]``, ``ReadOnly[X]`` and ``Annotated[X, ...]`` -> X."""
    while True:
        origin = get_origin(tp)
        if origin in (typing_extensions.Required, typing_extensions.NotRequired,
                      typing.Required, typing.NotRequired, typing_extensions.Annotated,
                      typing.Annotated):
            tp = get_args(tp)[0]
        elif getattr(tp, "__metadata__", None) is not None and hasattr(tp, "__origin__"):
            tp = tp.__origin__
        else:
            return tp


def _wire_name(hint: Any, name: str) -> str:
    """The key on the wire: a ``PropertyInfo(alias=...)`` in ``Annotated`` renames it."""
    for meta in getattr(hint, "__metadata__", ()):
        alias = getattr(meta, "alias", None)
        if isinstance(alias, str):
            return alias
    return name


@cache
def _fields(td: Any) -> tuple[dict[str, Any], frozenset[str]]:
    hints = typing_extensions.get_type_hints(td, include_extras=True)
    fields: dict[str, Any] = {}
    required: set[str] = set()
    for name, hint in hints.items():
        wire = _wire_name(hint, name)
        fields[wire] = _strip(hint)
        if name in td.__required_keys__:
            required.add(wire)
    return fields, frozenset(required)


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def check(value: Any, tp: Any, path: str = "") -> list[str]:
    """Every way ``value`` (decoded JSON) does not fit ``tp``; empty when it fits."""
    problems: list[str] = []
    _walk(value, tp, path or "body", problems)
    return problems


def _walk(value: Any, tp: Any, path: str, out: list[str]) -> None:
    tp = _strip(tp)
    if tp is Any or tp is object:
        return
    if tp is None or tp is _NONE:
        if value is not None:
            out.append(f"{path}: expected null")
        return
    origin = get_origin(tp)
    if origin is Literal:
        if value not in get_args(tp) or isinstance(value, bool) != any(
                isinstance(a, bool) for a in get_args(tp) if a == value):
            out.append(f"{path}: {value!r} is not one of {list(get_args(tp))}")
        return
    if origin is Union or origin is types.UnionType:
        options = get_args(tp)
        attempts: list[list[str]] = []
        for option in options:
            found: list[str] = []
            _walk(value, option, path, found)
            if not found:
                return
            attempts.append(found)
        # Name the closest option's problems (fewest), not every option's.
        best: list[str] = min(attempts, key=len)
        out.extend(best)
        return
    if _is_typed_dict(tp):
        if not isinstance(value, dict):
            out.append(f"{path}: expected an object ({_describe(tp)})")
            return
        fields, required = _fields(tp)
        for key in sorted(required - value.keys()):
            out.append(f"{path}.{key}: required by {_describe(tp)}")
        for key, item in value.items():
            if key not in fields:
                out.append(f"{path}.{key}: unknown parameter ({_describe(tp)} has no {key!r})")
                continue
            _walk(item, fields[key], f"{path}.{key}", out)
        return
    if tp is str:
        if not isinstance(value, str):
            out.append(f"{path}: expected a string")
        return
    if tp is bool:
        if not isinstance(value, bool):
            out.append(f"{path}: expected a boolean")
        return
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            out.append(f"{path}: expected an integer")
        return
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            out.append(f"{path}: expected a number")
        return
    if origin in (dict, collections.abc.Mapping, typing.Dict):  # noqa: UP006 - the SDKs use it
        if not isinstance(value, dict):
            out.append(f"{path}: expected an object")
            return
        args = get_args(tp)
        if len(args) == 2:
            for key, item in value.items():
                _walk(item, args[1], f"{path}.{key}", out)
        return
    if origin in (list, collections.abc.Iterable, collections.abc.Sequence, tuple) or (
            getattr(origin, "__name__", "") == "SequenceNotStr"):
        if not isinstance(value, list):
            out.append(f"{path}: expected an array")
            return
        args = get_args(tp)
        if args and origin is not tuple:
            for n, item in enumerate(value):
                _walk(item, args[0], f"{path}[{n}]", out)
        return
    if isinstance(tp, type):
        if tp in (bytes, bytearray) or issubclass(tp, collections.abc.Iterable):
            out.append(f"{path}: {_describe(tp)} cannot be sent as JSON")
        return  # other classes (file objects, PathLike): not JSON, not checked here
    # Anything else (a TypeVar, a Protocol): accepted, as the SDK would pass it through.
