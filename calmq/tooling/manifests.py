"""One description of the Kubernetes manifests, read two ways: rendered here in Python
(`calmq k8s render`) and written out as the Helm chart's templates (deploy/helm/calmq).

A manifest is a tree of plain dicts, lists and scalars in which some places are
*expressions* (a value from the chart's values, a name made from a pool's key, the image
reference, a checksum) and some entries are *conditional* (``When``), *repeated*
(``Each``) or *spread* from a value (``Spread``: extra labels, extra env). ``resolve``
evaluates the tree against a values mapping; ``helm_template`` writes the same tree as a
Go template. Both follow Helm's rules where they could differ: maps are ranged in key
order, a value is "empty" as Go templates judge it, values are merged as ``helm -f``
merges them (``merge_values``), and a setting's text is what the chart's ``calmq.text``
helper prints (``setting_text``). tests/unit/test_chart.py holds ``helm template`` to the
Python render for three value sets, so where they still differed it would fail.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from calmq.errors import ConfigError

__all__ = [
    "HELPERS",
    "Above",
    "And",
    "Check",
    "Checksum",
    "Context",
    "Dashed",
    "Default",
    "Doc",
    "Each",
    "Entries",
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
    "Spread",
    "Text",
    "Upper",
    "Val",
    "When",
    "Without",
    "config_data",
    "documents",
    "fullname",
    "go_json",
    "helm_template",
    "merge_values",
    "resolve",
    "setting_text",
]


# -- expressions ---------------------------------------------------------------------------


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


# -- structure -----------------------------------------------------------------------------


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


# -- Go's view of values -------------------------------------------------------------------


def _truthy(value: Any) -> bool:
    """Go templates' truth: false, 0, nil, and empty strings, maps and lists are false."""
    return bool(value)


def _go_float(value: float) -> str:
    """A float as fmt's %v prints it: the shortest digits, with an exponent below 1e-4 and
    from 1e6 on (strconv's 'g' format at its shortest precision)."""
    if value == 0:
        return "0"
    shortest = Decimal(repr(abs(value))).normalize()
    _sign, digits, exponent = shortest.as_tuple()
    text = "".join(map(str, digits))
    exp = len(text) + int(exponent) - 1
    minus = "-" if value < 0 else ""
    if exp < -4 or exp >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{minus}{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    return minus + format(shortest, "f")


def _go_str(value: Any) -> str:
    """What ``{{ value }}`` prints (fmt's %v) for a value read from YAML."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _go_float(value)
    return str(value)


def _json_float(value: float) -> str:
    """A float as Go's encoding/json writes it."""
    if value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    if 1e-6 <= abs(value) < 1e21:
        return format(Decimal(repr(value)), "f")
    text = repr(value)
    mantissa, exponent = text.split("e")
    sign, digits = exponent[0], exponent[1:].lstrip("0") or "0"
    return f"{mantissa}e{sign}{digits}" if sign == "-" else f"{mantissa}e+{digits}"


def go_json(value: Any) -> str:
    """``toJson`` as Helm's sprig writes it: sorted keys, no spaces, ``<``, ``>`` and ``&``
    escaped, numbers as Go prints a float64 (YAML numbers reach a template as float64)."""
    if isinstance(value, Mapping):
        items = sorted((str(k), v) for k, v in value.items())
        return "{" + ",".join(f"{go_json(k)}:{go_json(v)}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(go_json(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise ConfigError(f"{value} has no JSON form", code="invalid_values")
        return _json_float(value)
    text = json.dumps(str(value), ensure_ascii=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def setting_text(value: Any) -> str:
    """A value of the chart's ``config`` as its ``CALMQ_`` variable: strings as they are,
    booleans ``true``/``false``, whole numbers without a fraction (YAML ``8`` and ``8.0``),
    maps and lists as JSON (the price table). The chart's ``calmq.text`` helper prints the
    same."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (Mapping, list)):
        return go_json(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    return _go_str(value)


def config_data(values: Mapping[str, Any]) -> dict[str, str]:
    """The ConfigMap's data: each ``config`` entry as ``CALMQ_<NAME>``."""
    return {f"CALMQ_{k.upper()}": setting_text(v)
            for k, v in sorted((values.get("config") or {}).items())}


def config_checksum_text(values: Mapping[str, Any]) -> str:
    lines = [f"{k}={v}\n" for k, v in config_data(values).items()]
    return "".join(lines) + f"secretsVersion={_go_str(values.get('secretsVersion'))}\n"


# The chart's helpers: the Go twins of setting_text, Image, fullname, Fail and
# config_checksum_text.
HELPERS = """\
{{/* Every object's name prefix (calmq/tooling/manifests.py: fullname). */}}
{{- define "calmq.fullname" -}}
{{- if .Values.fullnameOverride -}}{{ .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else -}}
{{- $name := default "calmq" .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "calmq.failIf" -}}
{{- if index . 0 -}}{{- fail (index . 1) -}}{{- end -}}
{{- end -}}

{{/* A config value as its CALMQ_ variable spells it (calmq/tooling/manifests.py:
setting_text): YAML numbers arrive as float64, so a whole number drops its fraction. */}}
{{- define "calmq.text" -}}
{{- if kindIs "string" . -}}{{ . }}
{{- else if kindIs "bool" . -}}{{ ternary "true" "false" . }}
{{- else if or (kindIs "map" .) (kindIs "slice" .) -}}{{ toJson . }}
{{- else if kindIs "float64" . -}}
{{- if eq . (float64 (int64 .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else -}}{{ . }}
{{- end -}}
{{- end -}}

{{- define "calmq.image" -}}
{{- if .Values.image.digest -}}{{ printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else -}}{{ printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}
{{- end -}}
{{- end -}}

{{/* What checksum/config hashes: the ConfigMap's data, then secretsVersion. */}}
{{- define "calmq.checksumText" -}}
{{- range $k, $v := .Values.config }}
{{- printf "CALMQ_%s=%s\\n" (upper $k) (include "calmq.text" $v) }}
{{- end }}
{{- printf "secretsVersion=%s\\n" (toString (default "" .Values.secretsVersion)) }}
{{- end -}}
"""


# -- Python: resolve -----------------------------------------------------------------------


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
    if isinstance(node, list):
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
    return node


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


# -- Go: the chart's templates -------------------------------------------------------------


def _scalar_go(value: Any) -> str:
    """A literal scalar in a template: JSON (YAML reads it back), or, where it holds Go
    template braces (the alert rules' own templates), an action that prints it."""
    if isinstance(value, str) and ("{{" in value or "}}" in value):
        return "{{ " + f"toJson {json.dumps(value, ensure_ascii=False)}" + " }}"
    return json.dumps(value, ensure_ascii=False)


def _inline(value: Any) -> str | None:
    """The value's text on its key's line, or None for a block (maps, lists)."""
    if isinstance(value, Val) and value.block:
        return None
    if isinstance(value, Expr):
        return "{{ toJson " + value.go() + " }}"
    if isinstance(value, (dict, list)):
        return "{}" if value == {} else "[]" if value == [] else None
    return _scalar_go(value)


def _key_go(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _entry(key: str, value: Any, indent: int) -> list[str]:
    pad = " " * indent
    inline = _inline(value)
    if inline is not None:
        return [f"{pad}{_key_go(key)}: {inline}"]
    if isinstance(value, Val):
        return [f"{pad}{_key_go(key)}:" + "{{- toYaml " + value.go()
                + f" | nindent {indent + 2} " + "}}"]
    return [f"{pad}{_key_go(key)}:", *_block(value, indent + 2)]


def _block(node: Any, indent: int) -> list[str]:
    if isinstance(node, dict):
        lines: list[str] = []
        for key, value in node.items():
            if isinstance(key, Spread):
                lines += ["{{- with " + _lit_go(key.of) + " }}",
                          "{{- toYaml . | nindent " + str(indent) + " }}", "{{- end }}"]
            elif isinstance(key, Check):
                lines.append("{{- $_ := " + key.of.go() + " }}")
            elif isinstance(key, Entries):
                lines += ["{{- range $" + key.scope + "Name, $" + key.scope + " := "
                          + _lit_go(key.over) + " }}",
                          " " * indent + "{{ " + key.key.go() + " }}: "
                          + "{{ toJson " + key.value.go() + " }}", "{{- end }}"]
            elif isinstance(value, When):
                lines += ["{{- if " + _lit_go(value.cond) + " }}",
                          *_entry(key, value.body, indent), "{{- end }}"]
            else:
                lines += _entry(key, value, indent)
        return lines
    if isinstance(node, list):
        lines = []
        for item in node:
            if isinstance(item, Spread):
                lines += ["{{- with " + _lit_go(item.of) + " }}",
                          "{{- toYaml . | nindent " + str(indent) + " }}", "{{- end }}"]
            elif isinstance(item, Each):
                lines += [*_range_open(item), *_item(item.body, indent), *_range_close(item)]
            elif isinstance(item, When):
                lines += ["{{- if " + _lit_go(item.cond) + " }}", *_item(item.body, indent),
                          "{{- end }}"]
            else:
                lines += _item(item, indent)
        return lines
    raise TypeError(f"not a block: {node!r}")


def _item(node: Any, indent: int) -> list[str]:
    pad = " " * indent
    inline = _inline(node)
    if inline is not None:
        return [f"{pad}- {inline}"]
    inner = _block(node, indent + 2)
    if inner and not inner[0].startswith("{{"):
        return [f"{pad}- {inner[0][indent + 2:]}", *inner[1:]]
    return [f"{pad}-", *inner]


def _range_open(each: Each) -> list[str]:
    lines = ["{{- range $" + each.scope + "Name, $" + each.scope + " := "
             + _lit_go(each.over) + " }}"]
    if each.where is not None:
        lines.append("{{- if " + _lit_go(each.where) + " }}")
    return lines


def _range_close(each: Each) -> list[str]:
    return ["{{- end }}", "{{- end }}"] if each.where is not None else ["{{- end }}"]


def helm_template(docs: Sequence[Doc], header: str) -> str:
    """The chart template holding ``docs``, each after a ``---``."""
    lines = [f"{{{{- /* {header} */}}}}"]
    for doc in docs:
        if doc.items is not None:
            lines += ["{{- range " + doc.items.go() + " }}", "---",
                      "{{ toYaml . }}", "{{- end }}"]
            continue
        body = ["---", *_block(doc.body, 0)]
        if doc.each is not None:
            body = [*_range_open(doc.each), *body, *_range_close(doc.each)]
        if doc.when is not None:
            body = ["{{- if " + _lit_go(doc.when) + " }}", *body, "{{- end }}"]
        lines += body
    return "\n".join(lines) + "\n"
