"""/openapi.json: in step with the routes, and a property-based fuzz of the API from it."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from typing import Any

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, given

from calmq.producers.api import ROUTES
from calmq.producers.openapi import document
from calmq.tooling.devstack import StackState
from calmq.workflows import load_workflows
from tests.support.api import create_tenant

pytestmark = pytest.mark.e2e

PROBLEM_FIELDS = {"type", "title", "status", "detail", "code"}


def _header(headers: Any, name: str) -> str:
    for key, value in dict(headers).items():
        if key.lower() == name:
            return str(value[0] if isinstance(value, list) else value)
    return ""


def test_every_route_is_documented_and_every_documented_path_is_a_route() -> None:
    """ROUTES and the OpenAPI paths list the same (method, path) pairs."""
    routed = {(r.method.lower(), r.path) for r in ROUTES}
    documented = {(m, p) for p, ops in document(ROUTES, load_workflows())["paths"].items()
                  for m in ops}
    assert routed == documented


def test_served_document_is_the_module_document(stack: StackState) -> None:
    """GET /openapi.json serves producers.openapi.document() without authentication."""
    with urllib.request.urlopen(stack.env["CALMQ_API_URL"] + "/openapi.json", timeout=10) as r:
        served = json.loads(r.read())
    assert served == json.loads(json.dumps(document(ROUTES, load_workflows())))


def test_fuzz_from_openapi_has_no_5xx_and_every_error_is_problem_json(stack: StackState) -> None:
    """Schemathesis cases for every operation: never 5xx, documented status, errors problem+json."""
    url = stack.env["CALMQ_API_URL"]
    key = create_tenant(stack.env["CALMQ_DATABASE_URL"], f"fuzz-{uuid.uuid4().hex[:8]}")
    with urllib.request.urlopen(url + "/openapi.json", timeout=10) as resp:
        schema = schemathesis.openapi.from_dict(json.loads(resp.read()))
    failures: list[str] = []
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path == "/metrics":
            continue  # text exposition, no JSON or problem to check

        @hypothesis.settings(max_examples=20, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case: Any) -> None:
            response = case.call(base_url=url, headers={"Authorization": f"Bearer {key}"},
                                 timeout=10)
            status = response.status_code
            label = f"{case.method} {case.formatted_path} -> {status}"
            if status >= 500:
                failures.append(f"{label}: {response.text[:300]}")
            if str(status) not in operation.definition.raw["responses"]:  # noqa: B023
                failures.append(f"{label}: status not documented")
            if status >= 400:
                ctype = _header(response.headers, "content-type")
                body = response.json() if ctype.startswith("application/problem+json") else {}
                problem = ctype.startswith("application/problem+json")
                if not problem or not set(body) >= PROBLEM_FIELDS:
                    failures.append(f"{label}: not problem+json: {ctype} {response.text[:200]}")

        run()
    assert failures == [], "\n".join(sorted(set(failures))[:30])
    assert time.monotonic() - started < 120  # bounded: the suite must stay fast
