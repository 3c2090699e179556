"""The API's contract as a file: ``calmq openapi`` writes the OpenAPI 3.1 document.

It is the document the API serves at /openapi.json (producers.openapi over the same route
table and the same workflow registry), so a client generated from the file, or a contract
check in CI, needs no running server. docs/reference/openapi.json is this command's output
for the built-in workflows; tests/integration/test_openapi_file.py fails when it drifts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from calmq.cli.flags import Command, Flags, settings_environ

__all__ = ["register", "text"]


def text(document: dict[str, Any]) -> str:
    """The document as committed: indented and key-ordered as generated, one final newline,
    so that a regenerated file shows only what changed in a diff."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def cmd_openapi(args: argparse.Namespace) -> int:
    from calmq.producers.api import ROUTES
    from calmq.producers.openapi import document
    from calmq.settings import Settings
    from calmq.workflows import load_workflows

    # Only the workflow registry shapes the document (CALMQ_WORKFLOW_MODULES, entry
    # points); the stack's addresses do not, so no running stack is asked.
    settings = Settings.load({}, settings_environ(args))
    written = text(document(ROUTES, load_workflows(settings)))
    if args.output_file in (None, "", "-"):
        sys.stdout.write(written)
        return 0
    path = Path(args.output_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(written, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def register(command: Command, flags: Flags) -> None:
    p = command("openapi", cmd_openapi,
                "write the OpenAPI 3.1 document the API serves at /openapi.json (for the "
                "workflows registered here: built-in, entry points, CALMQ_WORKFLOW_MODULES)")
    flags.option(p, "--output-file", "-o",
                 help="where to write it (default: standard output)")
