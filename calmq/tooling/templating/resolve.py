"""The Python render: a manifest's tree with every expression evaluated and every
conditional decided (``resolve``), the documents of a values mapping, and ``helm -f``'s
merge of values files."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from calmq.tooling.templating.expressions import Expr, _ev
from calmq.tooling.templating.govalues import _go_str, _truthy
from calmq.tooling.templating.structure import Check, Context, Doc, Each, Entries, Spread, When

__all__ = [
    "documents",
    "merge_values",
    "resolve",
]


class _Omit:
    pass


_OMIT = _Omit()


def resolve(node: Any, ctx: Context) -> Any:
    """The tree with every expression evaluated and every conditional decided."""
    if isinstance(node, Expr):
        return copy.deepcopy(node.evaluate(ctx))
    if isinstance(node, When):
        return resolve(node.body, ctx) if _truthy(_ev(node.cond, ctx)) else _OMIT
    if isinstance(node, dict):
        return _resolve_map(node, ctx)
    if isinstance(node, list):
        return _resolve_list(node, ctx)
    return node


def _resolve_map(node: dict[Any, Any], ctx: Context) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(key, Spread):
            extra = _ev(key.of, ctx)
            if _truthy(extra):
                out.update(copy.deepcopy(dict(extra)))
            continue
        if isinstance(key, Check):
            key.of.evaluate(ctx)
            continue
        if isinstance(key, Entries):
            over = _ev(key.over, ctx) or {}
            for name in sorted(over):
                bound = ctx.bind(key.scope, name, over[name], None)
                out[_go_str(_ev(key.key, bound))] = resolve(key.value, bound)
            continue
        got = resolve(value, ctx)
        if got is not _OMIT:
            out[key] = got
    # A mapping whose every entry was conditional and left out is, in the template, a
    # key with nothing under it: YAML's null.
    return None if node and not out else out


def _resolve_list(node: list[Any], ctx: Context) -> list[Any] | None:
    items: list[Any] = []
    for item in node:
        if isinstance(item, Spread):
            extra = _ev(item.of, ctx)
            if _truthy(extra):
                items.extend(copy.deepcopy(list(extra)))
        elif isinstance(item, Each):
            items.extend(resolve(item.body, c) for c in _entries(item, ctx))
        else:
            got = resolve(item, ctx)
            if got is not _OMIT:
                items.append(got)
    return None if node and not items else items


def _entries(each: Each, ctx: Context) -> Iterator[Context]:
    over = _ev(each.over, ctx) or {}
    for key in sorted(over):
        bound = ctx.bind(each.scope, key, over[key], each.defaults)
        if each.where is None or _truthy(_ev(each.where, bound)):
            yield bound


def documents(docs: Sequence[Doc], ctx: Context) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, manifest) of every document the values render."""
    for doc in docs:
        if doc.chart_only or (doc.when is not None and not _truthy(_ev(doc.when, ctx))):
            continue
        if doc.items is not None:
            for i, item in enumerate(_ev(doc.items, ctx) or []):
                yield doc.file(ctx.bind("extra", str(i), item, None)), copy.deepcopy(item)
            continue
        for c in (_entries(doc.each, ctx) if doc.each is not None else [ctx]):
            yield doc.file(c), resolve(doc.body, c)


def merge_values(base: Mapping[str, Any], *overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``helm -f``'s merge: maps merge key by key, anything else replaces, null removes."""
    out = copy.deepcopy(dict(base))
    for over in overrides:
        _merge_into(out, over)
    return out


def _merge_into(target: dict[str, Any], over: Mapping[str, Any]) -> None:
    for key, value in over.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge_into(target[key], value)
        else:
            target[key] = _without_nulls(copy.deepcopy(value))


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value
