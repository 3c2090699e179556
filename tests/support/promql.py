"""What calmq exports, read from its code, and what a PromQL expression asks of it.

The catalogue comes from the code's ``Counter("calmq_...", ..., [labels])`` definitions,
found by parsing (ast), so metrics created lazily inside a function are included;
tests/unit/test_alerts.py checks it against what prometheus_client's registry holds once the
defining modules ran. The PromQL reading is small on purpose: it finds the metric names, the
label matchers of each selector and the grouping labels, which is all a rule or a panel needs
to be checked against the catalogue; it is no full PromQL parser.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

__all__ = ["Catalogue", "Metric", "Query", "catalogue", "read_query"]

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("calmq", "producers", "relay", "processors")
_KINDS = ("Counter", "Gauge", "Histogram", "Summary")
# Series a metric type exposes besides its own name.
_SUFFIXES = {"Counter": ("_created",), "Gauge": (),
             "Histogram": ("_bucket", "_sum", "_count", "_created"),
             "Summary": ("_sum", "_count", "_created")}


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # Counter, Gauge, Histogram or Summary
    labels: frozenset[str]
    path: str  # where it is defined, for the failure messages


@dataclass
class Catalogue:
    metrics: dict[str, Metric] = field(default_factory=dict)

    def series(self) -> dict[str, frozenset[str]]:
        """Every series name the metrics expose -> the labels it carries (``le`` on buckets,
        ``quantile`` on a summary's own name)."""
        out: dict[str, frozenset[str]] = {}
        for m in self.metrics.values():
            out[m.name] = m.labels | ({"quantile"} if m.kind == "Summary" else set())
            # A counter's samples are <base>_total and <base>_created (prometheus_client).
            base = m.name.removesuffix("_total") if m.kind == "Counter" else m.name
            for suffix in _SUFFIXES[m.kind]:
                out[base + suffix] = m.labels | ({"le"} if suffix == "_bucket" else set())
        return out


def _call_name(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _labels(node: ast.Call, path: Path) -> frozenset[str]:
    found: ast.expr | None = node.args[2] if len(node.args) > 2 else None
    for kw in node.keywords:
        if kw.arg == "labelnames":
            found = kw.value
    if found is None:
        return frozenset()
    if not isinstance(found, (ast.List, ast.Tuple)) or not all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in found.elts):
        raise AssertionError(f"{path}:{node.lineno}: write a metric's labels as a literal "
                             "list, so the alert and dashboard checks can read them")
    return frozenset(str(e.value) for e in found.elts if isinstance(e, ast.Constant))


@cache  # parsing every module takes a second; the tests only read the result
def catalogue() -> Catalogue:
    """Every calmq_* metric the code defines, with its type and labels."""
    cat = Catalogue()
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or _call_name(node) not in _KINDS:
                    continue
                if not node.args or not isinstance(node.args[0], ast.Constant):
                    continue
                name = node.args[0].value
                if not isinstance(name, str) or not name.startswith("calmq_"):
                    continue
                kind = _call_name(node) or ""
                metric = Metric(name, kind, _labels(node, path),
                                f"{path.relative_to(ROOT)}:{node.lineno}")
                previous = cat.metrics.setdefault(name, metric)
                if (previous.kind, previous.labels) != (kind, metric.labels):
                    raise AssertionError(f"{name} defined twice differently: {previous.path}"
                                         f" and {metric.path}")
    return cat


@dataclass
class Query:
    """What one PromQL expression refers to."""

    metrics: set[str] = field(default_factory=set)
    # (metric, label) for every matcher of a selector: up{job="x"} -> ("up", "job")
    matchers: set[tuple[str, str]] = field(default_factory=set)
    # labels of by (...), without (...), on (...), ignoring (...), group_left/right (...)
    grouping: set[str] = field(default_factory=set)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$[A-Za-z_]\w*")  # Grafana's $pool, ${datasource}
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}")
_BARE_SELECTOR = re.compile(r"\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_CLAUSE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"(?<![\w.])([A-Za-z_:][\w:]*)(?!\w)(\s*\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan"}


def read_query(expr: str) -> Query:
    """The metric names, selector matchers and grouping labels of a PromQL expression."""
    q = Query()
    text = _STRING.sub('""', expr)  # label values may hold anything, braces included
    text = _VARIABLE.sub("x", text)
    for metric, body in _SELECTOR.findall(text):
        if metric in _KEYWORDS:
            continue
        q.matchers.update((metric, label) for label in _MATCHER.findall(body))
    text = _BARE_SELECTOR.sub(" ", text)
    for _clause, labels in _CLAUSE.findall(text):
        q.grouping.update(x.strip() for x in labels.split(",") if x.strip())
    text = _CLAUSE.sub(" ", text)
    text = _RANGE.sub(" ", text)
    for name, call in _IDENT.findall(text):
        if call or name.lower() in _KEYWORDS or name == "x":
            continue  # a function (rate, sum, ...), an operator word, a Grafana variable
        q.metrics.add(name)
    return q
