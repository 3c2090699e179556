"""The expressions of a manifest: a value computed from the chart's values, evaluated in
Python (``evaluate``) and written as Go (``go``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from calmq.errors import ConfigError
from calmq.tooling.templating.govalues import _go_str, _truthy, config_checksum_text, setting_text

if TYPE_CHECKING:
    from calmq.tooling.templating.structure import Context

__all__ = [
    "Above",
    "And",
    "Checksum",
    "Dashed",
    "Default",
    "Expr",
    "Fail",
    "FileText",
    "FullName",
    "Has",
    "Image",
    "Key",
    "Namespace",
    "Not",
    "Or",
    "Printf",
    "Release",
    "Required",
    "Served",
    "Text",
    "Upper",
    "Val",
    "Without",
    "fullname",
]


class Expr:
    """A value computed from the chart's values (Python: ``evaluate``; Go: ``go``)."""

    def evaluate(self, ctx: Context) -> Any:
        raise NotImplementedError

    def go(self) -> str:
        raise NotImplementedError


def _lit_go(value: Any) -> str:
    """A Python literal as a Go template literal (JSON's string syntax is Go's)."""
    if isinstance(value, Expr):
        return value.go()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int):
        return str(value)
    raise TypeError(f"no Go literal for {value!r}")


def _ev(value: Any, ctx: Context) -> Any:
    return value.evaluate(ctx) if isinstance(value, Expr) else value


@dataclass(frozen=True)
class Val(Expr):
    """A value at ``path`` of the values (``scope`` "root"), or of the entry an ``Each``
    binds to ``scope``; an entry with ``defaults`` falls back, key by key, to that map
    (sprig's ``dig``: a key that is present wins, even when false or empty)."""

    path: tuple[str, ...]
    scope: str = "root"
    block: bool = False  # written as a YAML block (maps, lists), not as a JSON scalar

    def evaluate(self, ctx: Context) -> Any:
        if self.scope == "root":
            return _walk(ctx.values, self.path, strict=True)
        entry = ctx.scopes[self.scope]
        if not self.path:
            return entry.value
        found = _walk(entry.value, self.path, strict=False)
        if found is _MISSING and entry.defaults is not None:
            return _walk(ctx.values, (*entry.defaults, *self.path), strict=True)
        return None if found is _MISSING else found

    def go(self) -> str:
        if self.scope == "root":
            return _go_path("$.Values", self.path)
        if not self.path:
            return f"${self.scope}"
        keys = " ".join(json.dumps(k) for k in self.path)
        defaults = _SCOPE_DEFAULTS.get(self.scope)
        fallback = _go_path("$.Values", (*defaults, *self.path)) if defaults else "nil"
        return f"(dig {keys} {fallback} ${self.scope})"


_SCOPE_DEFAULTS: dict[str, tuple[str, ...]] = {}  # filled by Each: scope -> defaults path


def _go_path(root: str, path: Sequence[str]) -> str:
    if all(p.replace("_", "").isalnum() and not p[0].isdigit() for p in path):
        return ".".join((root, *path))
    return f"(index {root} {' '.join(json.dumps(p) for p in path)})"


_MISSING = object()


def _walk(node: Any, path: Sequence[str], *, strict: bool) -> Any:
    """The value at ``path``. ``strict`` as Go templates read ``.Values.a.b``: a missing
    last key is nil, a missing map on the way an error."""
    for i, key in enumerate(path):
        if not isinstance(node, Mapping):
            if strict:
                raise ConfigError(f"the values have no map {'.'.join(path[:i])}",
                                  code="invalid_values")
            return _MISSING
        if key not in node:
            if not strict:
                return _MISSING
            node = None
            continue
        node = node[key]
    return node


@dataclass(frozen=True)
class Key(Expr):
    """The key of the entry an ``Each`` binds to ``scope`` (a pool's name)."""

    scope: str

    def evaluate(self, ctx: Context) -> Any:
        return ctx.scopes[self.scope].key

    def go(self) -> str:
        return f"${self.scope}Name"


@dataclass(frozen=True)
class Printf(Expr):
    """``fmt`` with each ``%s`` replaced by an argument's text."""

    fmt: str
    args: tuple[Any, ...]

    def __init__(self, fmt: str, *args: Any) -> None:
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "args", args)

    def evaluate(self, ctx: Context) -> Any:
        return self.fmt % tuple(_go_str(_ev(a, ctx)) for a in self.args)

    def go(self) -> str:
        return f"(printf {json.dumps(self.fmt)} {' '.join(_lit_go(a) for a in self.args)})"


@dataclass(frozen=True)
class Dashed(Expr):
    """A name with ``_`` as ``-`` (Kubernetes names take no underscore)."""

    of: Any

    def evaluate(self, ctx: Context) -> Any:
        return _go_str(_ev(self.of, ctx)).replace("_", "-")

    def go(self) -> str:
        return f'(replace "_" "-" {_lit_go(self.of)})'


@dataclass(frozen=True)
class Upper(Expr):
    of: Any

    def evaluate(self, ctx: Context) -> Any:
        return _go_str(_ev(self.of, ctx)).upper()

    def go(self) -> str:
        return f"(upper {_lit_go(self.of)})"


@dataclass(frozen=True)
class Text(Expr):
    """A setting's value as its ``CALMQ_`` variable spells it (``setting_text``)."""

    of: Any

    def evaluate(self, ctx: Context) -> Any:
        return setting_text(_ev(self.of, ctx))

    def go(self) -> str:
        return f'(include "calmq.text" {_lit_go(self.of)})'


@dataclass(frozen=True)
class Required(Expr):
    """The value, or an error saying ``message`` when it is empty."""

    of: Any
    message: str

    def evaluate(self, ctx: Context) -> Any:
        value = _ev(self.of, ctx)
        if not _truthy(value):
            raise ConfigError(self.message, code="invalid_values")
        return value

    def go(self) -> str:
        return f"(required {json.dumps(self.message)} {_lit_go(self.of)})"


@dataclass(frozen=True)
class Default(Expr):
    """``of`` when it is not empty, else ``fallback`` (sprig's ``default``)."""

    of: Any
    fallback: Any

    def evaluate(self, ctx: Context) -> Any:
        value = _ev(self.of, ctx)
        return value if _truthy(value) else _ev(self.fallback, ctx)

    def go(self) -> str:
        return f"(default {_lit_go(self.fallback)} {_lit_go(self.of)})"


@dataclass(frozen=True)
class Namespace(Expr):
    """The namespace everything goes to: Helm's release namespace; the render's own."""

    def evaluate(self, ctx: Context) -> Any:
        return ctx.namespace

    def go(self) -> str:
        return "$.Release.Namespace"


@dataclass(frozen=True)
class Release(Expr):
    """The release's name: Helm's; the render's own (``calmq`` unless given)."""

    def evaluate(self, ctx: Context) -> Any:
        return ctx.release

    def go(self) -> str:
        return "$.Release.Name"


def fullname(values: Mapping[str, Any], release: str) -> str:
    """The prefix of every object's name, as Helm's ``<chart>.fullname`` convention makes
    it: ``fullnameOverride``, else the release's name when it holds the chart's name
    (``nameOverride`` or ``calmq``), else ``<release>-<name>``; at most 63 characters. A
    release named ``calmq`` keeps today's names, and two releases never share one."""
    override = _go_str(values.get("fullnameOverride"))
    if override:
        return override[:63].rstrip("-")
    name = _go_str(values.get("nameOverride")) or "calmq"
    out = release if name in release else f"{release}-{name}"
    return out[:63].rstrip("-")


@dataclass(frozen=True)
class FullName(Expr):
    """``fullname`` of the values and the release (Go: the chart's calmq.fullname)."""

    def evaluate(self, ctx: Context) -> Any:
        return fullname(ctx.values, ctx.release)

    def go(self) -> str:
        return '(include "calmq.fullname" $)'


@dataclass(frozen=True)
class Served(Expr):
    """Whether the cluster serves an API group/version (a custom resource's operator is
    installed): Helm asks the cluster (``.Capabilities.APIVersions``, or ``helm template
    --api-versions``), or takes the ``apiVersions`` value's word for it (``helm lint``,
    which cannot be told). The render has no cluster to ask: it renders what it is told."""

    api: str

    def evaluate(self, ctx: Context) -> Any:
        return True

    def go(self) -> str:
        api = json.dumps(self.api)
        return (f"(or ($.Capabilities.APIVersions.Has {api}) "
                f"(has {api} ($.Values.apiVersions | default list)))")


@dataclass(frozen=True)
class Above(Expr):
    """Whether the number ``of`` is above ``bound`` (YAML numbers reach Go as float64)."""

    of: Any
    bound: int

    def evaluate(self, ctx: Context) -> Any:
        value = _ev(self.of, ctx)
        return value is not None and float(value) > self.bound

    def go(self) -> str:
        return f"(gt (float64 (default 0 {_lit_go(self.of)})) {float(self.bound)!r})"


@dataclass(frozen=True)
class Fail(Expr):
    """An error saying ``message`` where ``cond`` holds (Go's ``fail``); else nothing."""

    cond: Any
    message: str

    def evaluate(self, ctx: Context) -> Any:
        if _truthy(_ev(self.cond, ctx)):
            raise ConfigError(self.message, code="invalid_values")
        return ""

    def go(self) -> str:
        # Not ternary: Go evaluates every argument, so fail must sit behind an if.
        return (f'(include "calmq.failIf" (list {_lit_go(self.cond)} '
                f"{json.dumps(self.message)}))")


@dataclass(frozen=True)
class Without(Expr):
    """The map ``of`` without ``keys`` where ``cond`` holds (sprig's ``omit``)."""

    of: Any
    keys: tuple[str, ...]
    cond: Any

    def evaluate(self, ctx: Context) -> Any:
        value = dict(_ev(self.of, ctx) or {})
        if _truthy(_ev(self.cond, ctx)):
            for key in self.keys:
                value.pop(key, None)
        return value

    def go(self) -> str:
        of = _lit_go(self.of)
        keys = " ".join(json.dumps(k) for k in self.keys)
        return f"(ternary (omit ({of} | default dict) {keys}) ({of} | default dict) " \
               f"(not (not {_lit_go(self.cond)})))"


@dataclass(frozen=True)
class Image(Expr):
    """``repository@digest`` when a digest is set, else ``repository:tag``."""

    def evaluate(self, ctx: Context) -> Any:
        image = ctx.values["image"]
        if _truthy(image.get("digest")):
            return f"{_go_str(image['repository'])}@{_go_str(image['digest'])}"
        return f"{_go_str(image['repository'])}:{_go_str(image['tag'])}"

    def go(self) -> str:
        return '(include "calmq.image" $)'


@dataclass(frozen=True)
class Checksum(Expr):
    """sha256 of the ConfigMap's data and ``secretsVersion`` (``config_checksum``): a
    change to either changes every pod template, so the pods roll."""

    def evaluate(self, ctx: Context) -> Any:
        return hashlib.sha256(config_checksum_text(ctx.values).encode()).hexdigest()

    def go(self) -> str:
        return '(include "calmq.checksumText" $ | sha256sum)'


@dataclass(frozen=True)
class FileText(Expr):
    """A file of the chart (``files/NAME``), as text."""

    name: str

    def evaluate(self, ctx: Context) -> Any:
        return ctx.files[self.name]

    def go(self) -> str:
        return f'($.Files.Get {json.dumps("files/" + self.name)})'


@dataclass(frozen=True)
class Not(Expr):
    of: Any

    def evaluate(self, ctx: Context) -> Any:
        return not _truthy(_ev(self.of, ctx))

    def go(self) -> str:
        return f"(not {_lit_go(self.of)})"


@dataclass(frozen=True)
class And(Expr):
    terms: tuple[Any, ...]

    def evaluate(self, ctx: Context) -> Any:
        value: Any = None
        for term in self.terms:  # Go's and: the first empty argument, or the last
            value = _ev(term, ctx)
            if not _truthy(value):
                return value
        return value

    def go(self) -> str:
        return f"(and {' '.join(_lit_go(t) for t in self.terms)})"


@dataclass(frozen=True)
class Or(Expr):
    terms: tuple[Any, ...]

    def evaluate(self, ctx: Context) -> Any:
        value: Any = None
        for term in self.terms:  # Go's or: the first non-empty argument, or the last
            value = _ev(term, ctx)
            if _truthy(value):
                return value
        return value

    def go(self) -> str:
        return f"(or {' '.join(_lit_go(t) for t in self.terms)})"


@dataclass(frozen=True)
class Has(Expr):
    """Whether the list ``of`` holds ``item``."""

    of: Any
    item: str

    def evaluate(self, ctx: Context) -> Any:
        found = _ev(self.of, ctx)
        return isinstance(found, list) and self.item in found

    def go(self) -> str:
        return f"(has {json.dumps(self.item)} {_lit_go(self.of)})"
