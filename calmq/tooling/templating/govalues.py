"""Go's view of values: what a template prints for a value (fmt's %v, sprig's ``toJson``),
what it takes as true, a setting's text as its ``CALMQ_`` variable, and the chart's
helpers that print the same (``HELPERS``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from calmq.errors import ConfigError

__all__ = [
    "HELPERS",
    "config_checksum_text",
    "config_data",
    "go_json",
    "setting_text",
]


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
