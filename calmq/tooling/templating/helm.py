"""The same trees written as the Helm chart's Go templates (``helm_template``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from calmq.tooling.templating.expressions import Expr, Val, _lit_go
from calmq.tooling.templating.structure import Check, Doc, Each, Entries, Spread, When

__all__ = [
    "helm_template",
]


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
