"""Problem ``type`` URIs resolve: every code the API can answer, and every failure code a job
can carry, is an anchor of docs/reference/api.md, and ``type`` is that anchor's URL."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from calmq.errors import ContractError, NotFound
from calmq.failure_codes import CODES
from calmq.producers.api import _errors
from calmq.producers.context import SETTINGS
from calmq.producers.problems import problem
from calmq.producers.throttle import TenantGates
from calmq.settings import PROBLEM_BASE_URL, Settings

ROOT = Path(__file__).resolve().parents[2]
API_DOCS = ROOT / "docs" / "reference" / "api.md"
# The API's own modules, where any constant ``code=`` is an answer it can give...
_API = [ROOT / "producers"]
# ...and the kernel modules it calls, where only the 4xx errors' codes reach a client.
_KERNEL = [*(ROOT / "calmq").glob("*.py"), *(ROOT / "calmq" / "data").rglob("*.py"),
           *(ROOT / "calmq" / "workflows").rglob("*.py")]
_CLIENT_ERRORS = {"ContractError", "NotFound", "Throttled"}


def answered_codes(source: str, *, api: bool) -> set[str]:
    """The constant problem codes a module names: ``problem(status, "code", ...)``, a
    ``code="..."`` argument (of a 4xx error's construction, or any call when ``api``), and a
    ``code: str = "..."`` parameter's default (``api`` only)."""
    codes: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if (name == "problem" and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant)):
                codes.add(str(node.args[1].value))
            if api or name in _CLIENT_ERRORS:
                codes |= {str(kw.value.value) for kw in node.keywords
                          if kw.arg == "code" and isinstance(kw.value, ast.Constant)}
        elif api and isinstance(node, ast.arguments):
            named = [*node.posonlyargs, *node.args]
            pairs = [*zip(named[len(named) - len(node.defaults):], node.defaults, strict=True),
                     *zip(node.kwonlyargs, node.kw_defaults, strict=True)]
            codes |= {str(d.value) for a, d in pairs
                      if a.arg == "code" and isinstance(d, ast.Constant)}
    return codes


def all_answered() -> set[str]:
    codes = {ContractError.code, NotFound.code}
    # Chosen at run time from a table: the per-tenant caps' codes.
    codes |= {code for code, *_ in TenantGates._KINDS.values()}
    for path in (p for base in _API for p in base.rglob("*.py")):
        codes |= answered_codes(path.read_text(), api=True)
    for path in _KERNEL:
        codes |= answered_codes(path.read_text(), api=False)
    return codes


def anchors() -> list[str]:
    return re.findall(r'<a id="([^"]+)"></a>', API_DOCS.read_text())


def test_every_code_the_api_answers_and_every_failure_code_has_an_anchor() -> None:
    """docs/reference/api.md has an anchor for each problem code and each failure code."""
    answered = all_answered()
    assert len(answered) > 50  # the scan finds the codes (it would pass vacuously otherwise)
    found = set(anchors())
    missing = sorted((answered | set(CODES)) - found)
    assert missing == [], ("add a row with <a id=\"CODE\"></a> to docs/reference/api.md's "
                           f"Problem codes for: {missing}")


def test_each_anchor_is_declared_once() -> None:
    """No code has two anchors (a link would land on the first only)."""
    seen = anchors()
    assert sorted({a for a in seen if seen.count(a) > 1}) == []


def test_the_scan_finds_each_way_a_code_is_named() -> None:
    """A problem() call, a code= argument and a code parameter's default are all found."""
    snippet = ('problem(404, "code_one", "x")\n'
               'raise ContractError("x", code="code_two", status=409)\n'
               'def parse(text, *, code: str = "code_three"): ...\n'
               'check(key, code="code_four")\n')
    assert answered_codes(snippet, api=True) == {"code_one", "code_two", "code_three",
                                                 "code_four"}
    assert answered_codes(snippet, api=False) == {"code_one", "code_two"}


def test_a_problems_type_is_its_codes_anchor_in_the_api_reference() -> None:
    """By default ``type`` is the GitHub URL of docs/reference/api.md with the code's anchor."""
    assert Settings().api_problem_base_url == PROBLEM_BASE_URL
    body = json.loads(problem(404, "no_route", "no route").text or "")
    assert body["type"] == PROBLEM_BASE_URL + "no_route"
    assert body["type"].endswith("/docs/reference/api.md#no_route")
    assert "no_route" in anchors()


async def test_the_api_answers_with_the_configured_problem_base() -> None:
    """The API's problems point under CALMQ_API_PROBLEM_BASE_URL when it is set."""
    async def missing(_request: web.Request) -> web.Response:
        raise NotFound("no such job")

    app = web.Application(middlewares=[_errors])
    app[SETTINGS] = Settings(api_problem_base_url="https://docs.example.com/calmq/api#")
    app.router.add_get("/v1/jobs/x", missing)
    async with TestClient(TestServer(app)) as client:
        found = await client.get("/v1/jobs/x")
        assert found.status == 404
        assert (await found.json())["type"] == "https://docs.example.com/calmq/api#not_found"
        nowhere = await client.get("/nowhere")
        assert (await nowhere.json())["type"] == "https://docs.example.com/calmq/api#no_route"
