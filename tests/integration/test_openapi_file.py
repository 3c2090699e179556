"""The contract as a file: docs/reference/openapi.json is what the API serves, `calmq
openapi` writes it, and a client generated from it by a standard generator
(openapi-typescript) compiles."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

from calmq import __version__
from calmq.cli import main
from calmq.tooling.devstack import StackState
from tests.support.npm import installed_client

pytestmark = pytest.mark.integration

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "reference" / "openapi.json"
REGENERATE = "regenerate it with `calmq openapi -o docs/reference/openapi.json`"

# Uses the generated types the way an application would: a submit body of one workflow,
# a job's status, a path's answer. tsc must accept it, and refuse nothing in the file.
_USE = """\
import type { components, paths } from "./openapi.js";

type Submit = paths["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"];
export const body: Submit = { workflow: "summarize", input: { text: "hello" } };
export const draft: Submit = { workflow: "draft", input: { prompt: "hi" },
                               priority: "interactive" };
type Job = paths["/v1/jobs/{job_id}"]["get"]["responses"]["200"]["content"]["application/json"];
export const done: Job["status"] = "completed";
export type Problem = components["schemas"]["Problem"];
export const code = (p: Problem): string => p.code;
"""


def test_the_committed_document_is_what_the_server_serves(stack: StackState) -> None:
    """docs/reference/openapi.json equals the live GET /openapi.json of the stack's API."""
    with urllib.request.urlopen(stack.env["CALMQ_API_URL"] + "/openapi.json", timeout=10) as r:
        served = json.loads(r.read())
    committed = json.loads(COMMITTED.read_text(encoding="utf-8"))
    assert committed == served, f"docs/reference/openapi.json drifted from the server: " \
                                f"{REGENERATE}"
    assert served["info"]["version"] == __version__


def test_calmq_openapi_writes_the_committed_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`calmq openapi -o FILE` writes docs/reference/openapi.json byte for byte."""
    for name in ("CALMQ_WORKFLOW_MODULES", "CALMQ_OUTPUT_FILE"):
        monkeypatch.delenv(name, raising=False)
    written = tmp_path / "openapi.json"
    assert main(["openapi", "-o", str(written)]) == 0
    assert written.read_text(encoding="utf-8") == COMMITTED.read_text(encoding="utf-8"), (
        REGENERATE)


def test_a_client_generated_from_the_document_compiles(tmp_path: Path) -> None:
    """openapi-typescript generates types from the committed file, and tsc --strict
    compiles them with code that uses them."""
    package = installed_client()
    bin_dir = package / "node_modules" / ".bin"
    generated = tmp_path / "openapi.d.ts"
    # A property with a default is one the server fills in: a request may leave it out
    # (the generator's own default would make every such field required).
    subprocess.run([str(bin_dir / "openapi-typescript"), str(COMMITTED), "-o", str(generated),
                    "--default-non-nullable", "false"],
                   cwd=package, check=True, capture_output=True, timeout=300)
    (tmp_path / "use.ts").write_text(_USE, encoding="utf-8")
    result = subprocess.run(
        [str(bin_dir / "tsc"), "--noEmit", "--strict", "--target", "es2022", "--module",
         "nodenext", "--moduleResolution", "nodenext", str(generated), str(tmp_path / "use.ts")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
