"""The chart's ``values.schema.json``, and the same check for `calmq k8s render`.

A misspelt value used to render with exit 0 and be ignored (``config.kafka_bootstap``: the
pods then connected to the default broker). The schema is generated, never written by
hand: ``config`` from ``Settings`` (a key for each setting, typed as its ``CALMQ_``
variable may be written), everything else from the renderer's own default values (a key
for each value it reads), with ``additionalProperties: false`` wherever the chart owns the
keys. Maps that are the user's (labels, annotations, node selectors, affinity, resources,
KEDA's HPA behavior) stay open. Helm checks the schema on install, upgrade, template and
lint; ``check_values`` applies the same schema to the values `calmq k8s render` merges,
so both refuse a typo with a message naming its path.
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr

from calmq.errors import ConfigError

__all__ = ["check_values", "schema_text", "values_schema"]

# Maps whose keys are the user's, by their key in the values: Kubernetes' own shapes or
# free-form labels, which the chart copies through as they are.
_OPEN = frozenset({"labels", "annotations", "podLabels", "podAnnotations", "commonLabels",
                   "nodeSelector", "affinity", "resources", "behavior",
                   "podSecurityContext", "securityContext"})
# Values that take more than their default's type (a PDB's minAvailable may be "50%", an
# image tag or a Secret's version may be written as a number).
_ALSO: dict[str, list[str]] = {"minAvailable": ["integer", "string"],
                               "maxUnavailable": ["integer", "string", "null"],
                               "tag": ["string", "number"],
                               "secretsVersion": ["string", "number"]}
_PARTS = ["api", "relay", "forwarder", "reaper", "worker", "batcher", "migrate",
          "kafka-setup"]


def _describe(path: str) -> dict[str, str]:
    from calmq.tooling.chart import COMMENTS

    note = COMMENTS.get(path)
    return {"description": note} if note else {}


def _setting_schema(annotation: Any) -> dict[str, Any]:
    """A setting's value in ``config``: its type, or the text its variable holds."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    if args and typing.get_origin(annotation) is not dict and len(args) == 1:
        return _setting_schema(args[0])  # X | None
    if annotation is bool:
        return {"type": ["boolean", "string"]}
    if annotation is int:
        return {"type": ["integer", "string"]}
    if annotation is float:
        return {"type": ["number", "string"]}
    if typing.get_origin(annotation) is dict:
        return {"type": ["object", "string"]}
    if annotation is SecretStr:
        return {"type": "string"}
    # Text: YAML may read an unquoted value as a number or a boolean, and a setting that
    # holds JSON (kafka_config) may be written as a map; calmq.text prints each as text.
    return {}


def _config_schema() -> dict[str, Any]:
    from calmq.settings import Settings

    props = {}
    for name, field in sorted(Settings.model_fields.items()):
        entry = _setting_schema(field.annotation)
        if field.description:
            entry = {"description": field.description, **entry}
        props[name] = entry
    return {"type": "object", **_describe("config"), "properties": props,
            "additionalProperties": False}


def _secret_refs(path: str) -> dict[str, Any]:
    """``secretSettings`` and ``secretFiles``: keyed by setting, each a Secret's key."""
    from calmq.settings import Settings

    entry = {"type": "object",
             "properties": {"secretName": {"type": "string"}, "key": {"type": "string"},
                            "parts": {"type": "array", "items": {"enum": _PARTS}}},
             "additionalProperties": False}
    return {"type": "object", **_describe(path),
            "propertyNames": {"enum": sorted(Settings.model_fields)},
            "additionalProperties": entry}


def _from_value(value: Any, path: tuple[str, ...]) -> dict[str, Any]:
    """The schema of a default value: a map's keys are the chart's, a scalar keeps its
    type."""
    dotted = ".".join(path)
    key = path[-1] if path else ""
    if isinstance(value, Mapping):
        if key in _OPEN:
            return {"type": "object", **_describe(dotted)}
        props = {k: _from_value(v, (*path, k)) for k, v in value.items()}
        return {"type": "object", **_describe(dotted), "properties": props,
                "additionalProperties": False}
    if key in _ALSO:
        out: dict[str, Any] = {"type": _ALSO[key]}
    elif isinstance(value, bool):
        out = {"type": "boolean"}
    elif isinstance(value, (int, float)):
        out = {"type": "number"}
    elif isinstance(value, str):
        out = {"type": "string"}
    elif isinstance(value, list):
        out = {"type": "array"}
    else:  # None: any value
        out = {}
    return {**_describe(dotted), **out}


def values_schema(values: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of the chart's values, for ``values`` of the renderer's shape."""
    top = _from_value({k: v for k, v in values.items()
                       if k not in ("config", "secretSettings", "secretFiles")}, ())
    props = top["properties"]
    props["config"] = _config_schema()
    props["secretSettings"] = _secret_refs("secretSettings")
    props["secretFiles"] = _secret_refs("secretFiles")
    # A pool names only what differs from poolDefaults (so the same keys, none required);
    # a null pool is one `calmq k8s values` removes by name.
    workers = props["workers"]["properties"]
    pool = json.loads(json.dumps(workers["poolDefaults"]))
    pool.pop("description", None)
    pool["type"] = ["object", "null"]
    workers["pools"] = {"type": "object", **_describe("workers.pools"),
                        "additionalProperties": pool}
    # Keep the values' order for a reader: config and the secret maps where they were.
    ordered = {k: props[k] for k in values if k in props}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "calmq chart values",
            "description": "Written by `calmq k8s chart` from Settings and the renderer's "
                           "default values; edit those, not this.",
            "type": "object", "properties": ordered, "additionalProperties": False}


def schema_text(values: Mapping[str, Any]) -> str:
    return json.dumps(values_schema(values), indent=2, ensure_ascii=False) + "\n"


@functools.cache
def _chart_schema() -> dict[str, Any]:
    from calmq.settings import Settings
    from calmq.tooling.kubernetes import default_values

    # The shape does not depend on the settings: pools are any name, config any setting.
    return values_schema(default_values(Settings.model_construct(), {}))


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (Mapping,), "array": (list, tuple), "string": (str,), "boolean": (bool,),
    "number": (int, float), "integer": (int,), "null": (type(None),)}


def _is(value: Any, kind: str) -> bool:
    if kind in ("number", "integer") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES[kind])


def _near(key: str, known: Mapping[str, Any]) -> str:
    import difflib

    close = difflib.get_close_matches(str(key), list(known), n=3)
    if close:
        return f" (did you mean {' or '.join(close)}?)"
    return f" (it takes {', '.join(known)})" if len(known) <= 20 else ""


def _errors(value: Any, schema: Mapping[str, Any], path: str) -> list[str]:
    """Where ``value`` breaks ``schema`` (the subset of JSON Schema values_schema uses)."""
    where = path or "the values"
    if "enum" in schema and value not in schema["enum"]:
        # Never the value itself: a misplaced secret must not reach the message.
        return [f"{where}: not one of {', '.join(map(str, schema['enum']))}"]
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            return [f"{where}: a {type(value).__name__}, not {' or '.join(kinds)}"]
    found: list[str] = []
    if isinstance(value, Mapping):
        props = schema.get("properties", {})
        names = schema.get("propertyNames", {}).get("enum")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            at = f"{path}.{key}" if path else str(key)
            if names is not None and key not in names:
                found.append(f"{at}: {key} is not a calmq setting")
            elif key in props:
                found += _errors(item, props[key], at)
            elif extra is False:
                found.append(f"{at}: the chart has no value {key} here{_near(key, props)}")
            elif isinstance(extra, Mapping):
                found += _errors(item, extra, at)
    return found


def check_values(values: Mapping[str, Any]) -> None:
    """Refuse values the chart's schema refuses, naming each path (as ``helm`` does)."""
    found = _errors(values, _chart_schema(), "")
    if found:
        raise ConfigError("the values do not meet the chart's schema: " + "; ".join(found),
                          code="invalid_values")
