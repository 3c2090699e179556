"""The holds registry (calmq.holds) owns every reason a job waits: the SQL and the Python set
and compare none it lacks, the statements, passes and metrics it names exist, the spend
release takes only its own reasons, and the API reference and the console say each."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from calmq import sql
from calmq.data.spending import Spend, SpendCap
from calmq.holds import HOLDS, notice, passes
from calmq.processors.releases import CODE
from calmq.producers.console.shaping import waiting_notice
from calmq.spending import _over

ROOT = Path(__file__).resolve().parents[2]
SQL_FILES = sorted((ROOT / "calmq" / "sql").glob("*.sql")) + sorted(
    (ROOT / "calmq" / "sql" / "migrations").glob("*.sql"))
# The base class of the timed waits: never raised itself, each subclass names its reason.
EXEMPT_CLASSES = {("calmq/failure_codes.py", "WaitUncounted")}

_COMMENT = re.compile(r"--[^\n]*")
_LITERAL = re.compile(r"'(\w+)'")
# where a statement sets or tests the reason: = / <> 'x', IN ('x', ...), NULLIF(reason, 'x'),
# a CASE yielding it (THEN / ELSE 'x' in a statement about waiting_reason), an alias named
# reason compared, and a waiting event's detail read (->>'reason' = 'x')
_COMPARED = re.compile(r"waiting_reason\s*(?:=|<>|!=)\s*'(\w+)'", re.IGNORECASE)
_IN_LIST = re.compile(r"waiting_reason\s+(?:NOT\s+)?IN\s*\(([^)]*)\)", re.IGNORECASE)
_ARGUMENT = re.compile(r"\(\s*[\w.]*waiting_reason\s*,\s*'(\w+)'", re.IGNORECASE)
_CASE = re.compile(r"\b(?:THEN|ELSE)\s+'([a-z_]+)'", re.IGNORECASE)
_ALIAS = re.compile(r"\breason\s*(?:=|<>|!=)\s*'(\w+)'", re.IGNORECASE)
_DETAIL = re.compile(r"->>\s*'reason'\s*(?:=|<>|!=)\s*'(\w+)'", re.IGNORECASE)
# the reason a waiting or resumed event's detail names (other events' reasons are theirs):
# 'waiting', attempt, jsonb_build_object('reason', 'x' ... or '{"reason": "x"}'
_EVENT = re.compile(r"'(?:waiting|resumed)'\s*,\s*[^,]+,\s*(?:jsonb_build_object\(\s*'reason'"
                    r"\s*,\s*'(\w+)'|'\{\s*\"reason\"\s*:\s*\"(\w+)\")", re.IGNORECASE)


def _statements(text: str) -> list[str]:
    return _COMMENT.sub("", text).split(";")


def sql_reasons(text: str) -> set[str]:
    """The waiting reasons SQL text sets or compares, as quoted literals."""
    found: set[str] = set()
    for stmt in _statements(text):
        for pattern in (_COMPARED, _ARGUMENT, _ALIAS, _DETAIL):
            found.update(pattern.findall(stmt))
        for listed in _IN_LIST.findall(stmt):
            found.update(_LITERAL.findall(listed))
        if "waiting_reason" in stmt.lower():
            found.update(_CASE.findall(stmt))
    return found


def sql_event_reasons(text: str) -> set[str]:
    """The reasons SQL text writes into a waiting or resumed event's detail."""
    return {a or b for stmt in _statements(text) for a, b in _EVENT.findall(stmt)}


def _is_reason(node: ast.AST) -> bool:
    """A name, attribute or detail read of a job's waiting reason."""
    if isinstance(node, ast.Name | ast.Attribute):
        return (node.id if isinstance(node, ast.Name) else node.attr) in (
            "waiting_reason", "reason")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return (node.func.attr == "get" and bool(node.args)
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in ("reason", "waiting_reason"))
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value in ("reason", "waiting_reason")
    return False


def python_reasons(source: str, module: str = "") -> set[str]:
    """The waiting reasons Python source sets or compares as constants: a ``waiting_reason=``
    argument (a literal, or a module constant), a comparison with a reason, and a class's
    ``reason = "..."`` (calmq.failure_codes.WaitUncounted's kinds)."""
    tree = ast.parse(source)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}

    def strings(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name) and node.id in constants:
            return {constants[node.id]}
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return {s for e in node.elts for s in strings(e)}
        return set()

    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "waiting_reason":
                    found |= strings(kw.value)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_reason(o) for o in operands):
                for o in operands:
                    found |= strings(o)
        elif isinstance(node, ast.ClassDef) and (module, node.name) not in EXEMPT_CLASSES:
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == "reason" for t in stmt.targets):
                    found |= strings(stmt.value)
    return found


def product_modules() -> list[Path]:
    """The installed package's modules (through its links to producers/, relay/ and
    processors/), the tooling aside: the fake provider's words are the providers'."""
    found = []
    for folder, _dirs, files in os.walk(ROOT / "calmq", followlinks=True):
        if "__pycache__" in folder or "tooling" in Path(folder).parts:
            continue
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def _where(found: dict[str, set[str]], reasons: set[str], name: str) -> None:
    for reason in reasons:
        found.setdefault(reason, set()).add(name)


def test_every_waiting_reason_in_the_sql_is_registered() -> None:
    """No SQL statement or migration sets or compares a waiting reason the registry lacks,
    and every event reason it writes is a hold's or its release's."""
    reasons: dict[str, set[str]] = {}
    events: dict[str, set[str]] = {}
    for path in SQL_FILES:
        text = path.read_text()
        _where(reasons, sql_reasons(text), path.name)
        _where(events, sql_event_reasons(text), path.name)
    assert {"fair_share", "concurrency_keys_waiting", "parent_in_flight", "token_quota",
            "provider_blocked", "children", "fleet_spend_cap_monthly"} <= set(reasons)
    assert {r: sorted(w) for r, w in reasons.items() if r not in HOLDS} == {}
    resumed = {h.resumed for h in HOLDS.values()}
    assert {"under_cap", "review_cap"} <= set(events)
    assert {r: sorted(w) for r, w in events.items()
            if r not in HOLDS and r not in resumed} == {}


def test_every_waiting_reason_in_the_python_is_registered() -> None:
    """No product module sets or compares a waiting reason the registry lacks."""
    found: dict[str, set[str]] = {}
    for path in product_modules():
        name = path.relative_to(ROOT).as_posix()
        _where(found, python_reasons(path.read_text(), name), name)
    assert {"provider_blocked", "children", "model_cooldown", "rate_limit_key"} <= set(found)
    assert {r: sorted(w) for r, w in found.items() if r not in HOLDS} == {}


def test_the_scans_catch_an_unregistered_reason() -> None:
    """A new reason set, compared or yielded in SQL or Python is found (so the tests above
    can fail)."""
    statement = ("UPDATE jobs SET waiting_reason = 'brand_new' WHERE waiting_reason IN "
                 "('also_new', 'fair_share') OR NULLIF(waiting_reason, 'third') IS NULL "
                 "OR (CASE WHEN x THEN 'fourth' END) = waiting_reason;\n"
                 "SELECT 1 FROM job_events WHERE detail->>'reason' = 'fifth';")
    assert {"brand_new", "also_new", "third", "fourth", "fifth"} <= sql_reasons(statement)
    assert sql_event_reasons(
        "SELECT id, 'resumed', attempt, '{\"reason\": \"sixth\"}'::jsonb FROM moved; "
        "SELECT id, 'waiting', attempt - 1,\n jsonb_build_object('reason', 'seventh') FROM h; "
        "SELECT id, 'requeued', attempt, '{\"reason\": \"not_a_hold\"}'::jsonb FROM r"
    ) == {"sixth", "seventh"}
    source = ('NEW = "new_one"\n'
              'store.finish(waiting_reason=NEW)\n'
              'if job.waiting_reason == "another": pass\n'
              'if d.get("reason") in ("third_one",): pass\n'
              'class Cooling(WaitUncounted):\n    reason = "fourth_one"\n')
    assert python_reasons(source) == {"new_one", "another", "third_one", "fourth_one"}
    assert not {"brand_new", "new_one", "fourth_one"} & set(HOLDS)


def test_the_spend_caps_reasons_are_registered() -> None:
    """The spend caps' reasons, built from their window's name (calmq.spending), are rows."""
    for cap in (SpendCap(1.0, None), SpendCap(None, 1.0)):
        every, bulk = _over(Spend(2.0, 2.0), cap, 0.5)
        assert every is not None
        assert bulk == every
        assert every in HOLDS
        assert f"fleet_{every}" in HOLDS


def _product_text() -> str:
    return "\n".join(p.read_text() for p in product_modules())


def test_each_hold_names_statements_passes_and_metrics_that_exist() -> None:
    """Every statement a row names is a query of calmq/sql (or a migration's trigger
    function), every task a housekeeping task, every metric a registered one."""
    queries = set(sql.queries())
    functions = {m for _v, _n, text in sql.migrations()
                 for m in re.findall(r"FUNCTION (\w+)\(", text)}
    text = _product_text()
    for hold in HOLDS.values():
        for statement in (*hold.holds, *hold.releases):
            assert statement in queries | functions, (hold.reason, statement)
        assert hold.holds, hold.reason
        assert hold.releases, hold.reason
        assert all((hold.set_by, hold.released_by, hold.api)), hold.reason
        if hold.task:
            assert f'"{hold.task}' in text, (hold.reason, hold.task)
        for release in hold.passes:
            assert release.statement in queries, (hold.reason, release.task)
    for task, (release, reasons) in passes().items():
        assert any(release.statement in HOLDS[r].releases for r in reasons), task
        for metric in re.findall(r"calmq_\w+", hold.metric):
            assert f'"{metric}"' in text, (hold.reason, metric)


def test_the_housekeeping_runs_the_passes_the_registry_declares() -> None:
    """Every pass with code of its own (processors/releases.py) is a registered hold's, and
    each registered pass is declared one way (its statement and pace) by all its holds."""
    registered = passes()
    assert set(CODE) <= set(registered)
    assert {"spend-release", "quota-release", "fair-share-stale", "fair-share-picked",
            "concurrency-key-release", "timed-wait-release",
            "review-cap-release"} == set(registered)
    assert registered["spend-release"][1] == (
        "spend_cap_daily", "spend_cap_monthly", "fleet_spend_cap_daily",
        "fleet_spend_cap_monthly", "token_quota")


def test_the_spend_release_pass_releases_only_the_reasons_it_owns() -> None:
    """release_jobs (every spend_cap_refresh_seconds) takes exactly the reasons whose row
    names it: a job held for its key, a room, a provider or its children is not re-published
    there and logged as a spend-cap release."""
    owned = {h.reason for h in HOLDS.values() if "release_jobs" in h.releases}
    assert owned == {"spend_cap_daily", "spend_cap_monthly", "fleet_spend_cap_daily",
                     "fleet_spend_cap_monthly", "token_quota"}
    assert sql_reasons(sql.queries()["release_jobs"]) == owned


def test_the_api_reference_names_every_reason() -> None:
    """docs/reference/api.md names each registered waiting reason."""
    text = (ROOT / "docs" / "reference" / "api.md").read_text()
    assert [r for r in HOLDS if f"`{r}`" not in text] == []


@pytest.mark.parametrize("reason", sorted(HOLDS))
def test_the_console_says_why_a_job_waits_for_each_reason(reason: str) -> None:
    """A job page names each registered reason's sentence, not the history's pointer; the
    review cap keeps its own notice."""
    kind = "children_spawned" if reason == "children" else "waiting"
    events = [{"type": "queued", "detail": {}},
              {"type": kind, "detail": {"reason": reason, "key": "k-1", "pool": "p"}}]
    shown = waiting_notice(events)
    if HOLDS[reason].says is None:
        assert shown is None
        return
    assert shown is not None
    assert shown["reason"] == reason
    assert shown["text"] == notice(reason, events[1]["detail"])
    assert "see its history below" not in shown["text"]


def test_an_unknown_reason_points_at_the_history() -> None:
    """A reason this console does not know (a newer worker's) points at the history."""
    shown = waiting_notice([{"type": "waiting", "detail": {"reason": "from_the_future"}}])
    assert shown == {"reason": "from_the_future", "text": "see its history below"}
