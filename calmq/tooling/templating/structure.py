"""The structure of a manifest around its expressions: conditional (``When``), repeated
(``Each``, ``Entries``) and spread (``Spread``) entries, checks, documents, and the
context a render evaluates them in."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from calmq.tooling.templating.expressions import _SCOPE_DEFAULTS, Expr, Val

__all__ = [
    "Bound",
    "Check",
    "Context",
    "Doc",
    "Each",
    "Entries",
    "Spread",
    "When",
]


@dataclass(frozen=True)
class When:
    """``body`` where ``cond`` holds: a dict entry, a list item or a whole document."""

    cond: Any
    body: Any


@dataclass(frozen=True)
class Each:
    """``body`` once per entry of the map ``over`` (in key order, as Go ranges a map), with
    the entry bound to ``scope``; ``where`` filters the entries. ``defaults``: the path of
    a map the entries fall back to, key by key (a pool names only what differs)."""

    over: Any
    scope: str
    body: Any
    where: Any = None
    defaults: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.defaults is not None:
            _SCOPE_DEFAULTS[self.scope] = self.defaults


@dataclass(frozen=True)
class Entries:
    """As a dict key (value ``None``): one entry per entry of the map ``over``, bound to
    ``scope``, with the key ``key`` and the value ``value`` (expressions)."""

    over: Any
    scope: str
    key: Any
    value: Any


@dataclass(frozen=True)
class Check:
    """As a dict key (value ``None``): evaluate ``of`` (a ``Required``) and write nothing."""

    of: Expr


@dataclass(frozen=True)
class Spread:
    """As a dict key (value ``None``): the entries of a map value; as a list item: the
    items of a list value. Empty or absent: nothing."""

    of: Any


@dataclass(frozen=True)
class Doc:
    """A document: ``file`` names it in the rendered folder (a pool's key may be in it),
    ``template`` is the chart template it is written to."""

    file: Callable[[Context], str]
    template: str
    body: Any
    when: Any = None
    each: Each | None = None  # the body once per entry (its ``body`` is ignored)
    chart_only: bool = False  # Helm's alone (a `helm test` pod): never in the render
    items: Val | None = None  # each item of this list value a document, as it is


@dataclass
class Bound:
    key: str
    value: Any
    defaults: tuple[str, ...] | None


@dataclass
class Context:
    values: Mapping[str, Any]
    namespace: str
    files: Mapping[str, str] = field(default_factory=dict)
    scopes: dict[str, Bound] = field(default_factory=dict)
    release: str = "calmq"

    def bind(self, scope: str, key: str, value: Any, defaults: tuple[str, ...] | None
             ) -> Context:
        return Context(self.values, self.namespace, self.files,
                       {**self.scopes, scope: Bound(key, value, defaults)}, self.release)
