"""What every command prints: one ``-o table|json|jsonl`` option, the exit codes, the errors.

``json`` prints one document (an object, or an array of rows), ``jsonl`` one JSON object per
line (a row, or a bulk action's outcome, as it happens), ``table`` aligned columns for a
person. Rows are the API's JSON shapes, so a script reads the CLI and the API alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Any, Literal, TextIO

__all__ = ["OUTPUT_ENV", "Exit", "Format", "add_output", "emit_lines", "emit_one", "emit_rows",
           "jsonable", "output_format"]

Format = Literal["table", "json", "jsonl"]
FORMATS: tuple[Format, ...] = ("table", "json", "jsonl")
# Like every flag, -o reads a CALMQ_ variable: a script can export CALMQ_OUTPUT=jsonl once.
OUTPUT_ENV = "CALMQ_OUTPUT"


class Exit(IntEnum):
    """The documented exit codes (docs/reference/cli.md)."""

    OK = 0
    ERROR = 1  # an expected failure: `calmq: error [code]: what to do` on stderr
    USAGE = 2  # a flag or argument the command cannot use (argparse's code, too)
    PARTIAL = 3  # a bulk action that did some of its work: the summary says what not


def add_output(p: argparse.ArgumentParser, default: Format = "table") -> None:
    """``-o/--output``; ``--json`` stays as a synonym of ``-o json`` for existing scripts."""
    p.add_argument("-o", "--output", choices=list(FORMATS), default=None,
                   help=f"output format (default {default}): table for people, json one "
                        f"document, jsonl one object per line [{OUTPUT_ENV}]")
    p.set_defaults(output_default=default)


def output_format(args: argparse.Namespace) -> Format:
    if getattr(args, "output", None):
        fmt: Format = args.output
        return fmt
    if getattr(args, "json", False):
        return "json"
    env = os.environ.get(OUTPUT_ENV, "")
    if env:
        from calmq.errors import UsageError

        if env not in FORMATS:
            raise UsageError(f"{OUTPUT_ENV}={env} is not one of {', '.join(FORMATS)}")
        chosen: Format = env  # narrowed by the check against FORMATS above
        return chosen
    default: Format = getattr(args, "output_default", "table")
    return default


def jsonable(value: Any) -> Any:
    """Dataclasses' dicts, datetimes and UUIDs as the API writes them (ISO text, strings)."""
    return json.loads(json.dumps(value, default=str))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str, separators=(",", ":"))
    return str(value)


def emit_rows(rows: Sequence[Mapping[str, Any]], fmt: Format, columns: Sequence[str],
              *, out: TextIO | None = None, empty: str = "nothing found") -> None:
    """A list: an array (json), a line per row (jsonl) or the ``columns`` as a table."""
    out = out or sys.stdout
    if fmt == "json":
        print(json.dumps(jsonable(list(rows)), indent=2), file=out)
        return
    if fmt == "jsonl":
        for row in rows:
            print(json.dumps(jsonable(row)), file=out)
        return
    if not rows:
        print(empty, file=out)
        return
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip(),
          file=out)
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip(), file=out)


def emit_one(obj: Mapping[str, Any], fmt: Format, *, out: TextIO | None = None) -> None:
    """One object: indented JSON, one line of JSON, or ``key  value`` lines."""
    out = out or sys.stdout
    if fmt == "json":
        print(json.dumps(jsonable(obj), indent=2), file=out)
    elif fmt == "jsonl":
        print(json.dumps(jsonable(obj)), file=out)
    else:
        width = max((len(k) for k in obj), default=0)
        for key, value in obj.items():
            print(f"{key.ljust(width)}  {_cell(value)}", file=out)


def emit_lines(lines: Iterable[str], *, out: TextIO | None = None) -> None:
    for line in lines:
        print(line, file=out or sys.stdout)
