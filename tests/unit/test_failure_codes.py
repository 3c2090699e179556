"""The failure-code registry (calmq.failure_codes) owns every code calmq raises: the source
raises none it lacks, the gateway classifies only into it, the retry policy and the budget
read it, and the providers reference's failure table is the registry's own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from calmq.calls.wires import classify_status
from calmq.errors import FailureClass, StepFailure
from calmq.failure_codes import CODES, BudgetEffect, docs_table, failure, spec
from calmq.retrying import Backoff

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "calmq", ROOT / "processors", ROOT / "producers", ROOT / "relay"]
_RAISERS = {"StepFailure", "failure", "ProviderBlocked"}


def raised_codes(source: str) -> set[str]:
    """The constant codes a module's StepFailure / failure(...) constructions name."""
    codes: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        if name not in _RAISERS:
            continue
        for kw in node.keywords:
            if kw.arg == "code" and isinstance(kw.value, ast.Constant):
                codes.add(str(kw.value.value))
        if name == "failure" and node.args and isinstance(node.args[0], ast.Constant):
            codes.add(str(node.args[0].value))
    return codes


def _all_raised() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for base in SOURCES:
        for path in base.rglob("*.py"):
            if "tooling" in path.parts:
                continue  # the fake provider's own error codes are the providers', not calmq's
            for code in raised_codes(path.read_text()):
                found.setdefault(code, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_code_calmq_raises_is_registered() -> None:
    """No StepFailure in the source names a code the registry lacks."""
    raised = _all_raised()
    assert len(raised) > 20  # the scan finds the codes (it would pass vacuously otherwise)
    missing = {code: sorted(where) for code, where in raised.items() if code not in CODES}
    assert missing == {}


def test_the_scan_catches_an_unregistered_code() -> None:
    """The scan names a code that is not registered (so the test above can fail)."""
    snippet = 'raise StepFailure("x", code="brand_new_code", failure_class=F.INPUT)\n' \
              'raise failure("another_new_one", "y")\n'
    assert {"brand_new_code", "another_new_one"} <= raised_codes(snippet)
    assert "brand_new_code" not in CODES


def test_registry_entries_agree_with_themselves() -> None:
    """Retried means transient and not a pause; a pause is the fleet's (class permission)."""
    for entry in CODES.values():
        assert entry.retried == (entry.failure_class is FailureClass.TRANSIENT
                                 and entry.budget is not BudgetEffect.PAUSE)
        if entry.pauses:
            assert entry.failure_class is FailureClass.PERMISSION
    assert {c for c, e in CODES.items() if e.pauses} == {
        "provider_auth", "provider_permission", "model_not_found", "insufficient_quota"}


@pytest.mark.parametrize(("status", "body", "headers", "code"), [
    (429, "{}", {"retry-after-ms": "1200"}, "rate_limited"),
    (429, '{"error":{"code":"insufficient_quota"}}', None, "insufficient_quota"),
    (402, '{"type":"error","error":{"type":"billing_error"}}', None, "insufficient_quota"),
    (400, '{"error":{"code":"context_length_exceeded"}}', None, "context_length_exceeded"),
    (400, '{"error":{"message":"prompt is too long: 210000 tokens"}}', None,
     "context_length_exceeded"),
    (400, '{"error":{"code":"content_policy_violation"}}', None, "content_policy"),
    (400, "{}", None, "provider_bad_request"),
    (401, "{}", None, "provider_auth"),
    (403, "{}", None, "provider_permission"),
    (404, "{}", None, "model_not_found"),
    (408, "{}", None, "timeout"),
    (413, "{}", None, "request_too_large"),
    (500, "{}", None, "upstream_unavailable"),
    (503, "{}", {"Retry-After": "3"}, "upstream_unavailable"),
    (529, "{}", None, "provider_overloaded"),
])
def test_classify_status_answers_registered_codes(status: int, body: str,
                                                  headers: dict[str, str] | None,
                                                  code: str) -> None:
    """Each provider answer becomes its registered code, with the registry's class."""
    found = classify_status(status, body, headers)
    assert found.code == code
    assert found.failure_class is CODES[code].failure_class


def test_the_retry_policy_reads_the_registry() -> None:
    """A registered code is retried as the registry says; a workflow's own code by class."""
    from calmq.processors.policy import decide

    tiers = [("1s", 1.0), ("5s", 5.0)]
    backoff = Backoff(0.1, 1.0)
    assert decide(failure("rate_limited", "x"), 1, 3, tiers, backoff).retry
    assert not decide(failure("provider_auth", "x"), 1, 3, tiers, backoff).retry
    assert not decide(failure("context_length_exceeded", "x"), 1, 3, tiers, backoff).retry
    own = StepFailure("x", code="my_workflows_own", failure_class=FailureClass.TRANSIENT)
    assert spec(own.code, own.failure_class).budget is BudgetEffect.KEEP
    assert decide(own, 1, 3, tiers, backoff).retry


def test_the_providers_reference_has_the_registrys_table() -> None:
    """docs/reference/providers.md carries the failure table the registry generates."""
    text = (ROOT / "docs" / "reference" / "providers.md").read_text()
    assert docs_table() in text
