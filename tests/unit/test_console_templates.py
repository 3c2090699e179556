"""Every console page renders from its template with records of each kind, escaping what
they carry (a job's metadata, a model's output, a tenant's name) in text and attributes."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from calmq.data.children import ChildrenSummary, ChildView
from calmq.data.console import ConsoleJob, JobPage, QueuedReview, Review
from calmq.data.deadletters import DeadLetter
from calmq.data.jobs import HistoryEvent
from calmq.data.providers import ProviderState
from calmq.lag import GroupLag
from calmq.producers.console.reads import Family, JobView
from calmq.producers.console.session import Page
from calmq.producers.console.shaping import (
    lag_view,
    output_fields,
    overview_view,
    preview,
    providers_view,
)
from calmq.producers.console.templates import environment

NOW = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
EVIL = '<script>alert("x")</script>'
PAGE = Page("acme", uuid.uuid4(), "cq_1234", ("submit", "review", "operate"), True, "tok",
            "tenant acme key cq_1234")


def _job(**kw: Any) -> JobPage:
    values: dict[str, Any] = {
        "id": uuid.uuid4(), "tenant": EVIL, "tenant_id": uuid.uuid4(), "workflow": "w",
        "workflow_version": 1, "status": "dead_letter", "priority": "bulk", "lane": "online",
        "pool": "p", "step": "s", "attempt": 1, "max_attempts": 3, "created_at": NOW,
        "updated_at": NOW, "deadline_at": None, "review_deadline_at": None,
        "trace_parent": None, "metadata": {"note": EVIL}, "input_tokens": 1,
        "output_tokens": 2, "cost_usd": 0, "error": {"class": "bug", "code": "x",
                                                      "message": EVIL},
        "artifact": {"uri": "file:///a", "size": 3}, "input_ref": None,
        "input_preview": '{"a": 1}', "input_bytes": 8, **kw}
    return JobPage(**values)


def _pages() -> dict[str, dict[str, Any]]:
    job = _job()
    events = [HistoryEvent(1, "queued", NOW, 0, {}),
              HistoryEvent(2, "dead_lettered", NOW, 1, {"code": "x", "class": "bug",
                                                        "message": EVIL})]
    view = JobView(job=job, events=events, attempts=[], last_event=2, input_preview=None,
                   artifact_preview=preview(b'{"summary": "<b>"}', 18, "application/json"))
    review = Review(id=uuid.uuid4(), tenant="acme", tenant_id=uuid.uuid4(), workflow="w",
                    step="s", pool="p", review_deadline_at=NOW, updated_at=NOW,
                    created_at=NOW, confidence=0.4, input_preview=EVIL, input_bytes=40,
                    input_ref=None, output={"vendor": EVIL, "paid": True})
    queued = QueuedReview(review.id, "acme", review.tenant_id, "w", "s", "p", NOW, NOW, NOW,
                          0.4)
    common = {"page": PAGE, "current": "", "title": EVIL}
    return {
        "job.html": {**common, "job": job, "view": view, "terminal": True,
                     "event_types": "queued", "held_for_review_cap": False,
                     "wait": {"reason": EVIL, "text": EVIL},
                     "attempts": [], "trace_id": "-", "can_cancel": True,
                     "rerun_steps": [EVIL],
                     # A parent of children, itself a child: the tree section with all of
                     # it, a join and a child whose names are the attacker's.
                     "family": Family(
                         ChildrenSummary(counts={"completed": 1, "queued": 1},
                                         joins=[{"step": EVIL, "policy": "at_least", "k": 1,
                                                 "n": 2, "succeeded": 1, "failed": 0,
                                                 "outcome": None}],
                                         parent_id=uuid.uuid4()),
                         [ChildView(uuid.uuid4(), 0, EVIL, "queued", 1, EVIL, None, None,
                                    NOW, NOW)])},
        "overview.html": {**common, "now": NOW, "set_caps": True, "platform_view": True,
                          "slots": [[EVIL, "yes", "1"]],
                          "lag": lag_view([GroupLag("calmq.p", EVIL, 5, 2)]),
                          "view": {**overview_view(
                              backlog=[{"pool": EVIL, "priority": "bulk", "lane": "online",
                                        "status": "queued", "jobs": 2,
                                        "oldest_seconds": 3.0}],
                              outcomes=[], spend=[], budget=[], review_caps={},
                              review_cap_held={}, now=NOW), **providers_view(
                              [ProviderState(f"openai:{EVIL}", EVIL, EVIL, "provider_auth",
                                             EVIL, NOW, 0.0, None, None, None)],
                              [("openai", EVIL)], platform=True, now=NOW)}},
        "jobs.html": {**common, "rows": [ConsoleJob(uuid.uuid4(), EVIL, "w", "queued",
                                                    "bulk", "online", "p", "s", 0, NOW, NOW,
                                                    {})],
                      "platform": True, "live": "/console/jobs/rows?q=%22",
                      "filters": {"statuses": ["queued"], "chosen_statuses": [],
                                  "workflows": ["w"], "priorities": ["bulk"],
                                  "lanes": ["online"], "params": {"q": EVIL},
                                  "query": SimpleNamespace(workflow=None, priority=None,
                                                           lane=None)}},
        "reviews.html": {**common, "rows": [(queued, -1.0), (queued, None)]},
        "review.html": {**common, "review": review, "error": EVIL, "input_preview": None,
                        "left": "overdue",
                        "fields": [(n, k, str(v), v, r)
                                   for n, k, v, r in output_fields(None, review.output)]},
        "dead_letters.html": {**common, "groups": [
            {"key": f"w|s|bug|{EVIL}", "failure_class": "bug", "code": EVIL,
             "workflow": "w", "step": "s", "count": 0, "oldest": None, "newest": None,
             "url": None}]},
        "dead_letter_group.html": {**common, "group": EVIL, "rows": [DeadLetter(
            uuid.uuid4(), uuid.uuid4(), EVIL, "w", 1, "bulk", "p", "s", 3,
            {"message": EVIL}, NOW, NOW)]},
        "redrive_confirm.html": {**common, "ids": [uuid.uuid4()], "reason": EVIL},
        "redrive_result.html": {**common, "redriven": 0, "others": [[EVIL, "x", None, ""]]},
        "sign_in.html": {**common, "page": None, "next": EVIL, "csrf": EVIL, "error": EVIL},
        "error.html": {**common, "code": EVIL, "message": EVIL},
    }


@pytest.mark.parametrize("name", sorted(_pages()))
def test_the_page_renders_and_escapes_what_it_shows(name: str) -> None:
    """The template renders a whole page, and no value it was given comes out as markup."""
    html = environment().get_template(name).render(**_pages()[name])
    assert html.startswith("<!doctype html>")
    assert html.rstrip().endswith("</html>")
    assert "<script>alert" not in html
    assert "&lt;script&gt;" in html


def test_the_live_fragments_render_with_the_pages_templates() -> None:
    """The rows a live refresh fetches come from the template the page includes."""
    env = environment()
    pages = _pages()
    rows = env.get_template("_jobs_table.html").render(
        rows=pages["jobs.html"]["rows"], platform=True)
    assert rows.count("<tr>") == 2  # the head and the one job
    assert "<td>bulk</td>" in rows  # the Priority column
    groups = env.get_template("_dead_letter_groups.html").render(
        groups=pages["dead_letters.html"]["groups"])
    assert 'class="count"' in groups
    items = env.get_template("_timeline_items.html").render(
        events=pages["job.html"]["view"].events)
    assert items.count("<li ") == 2
    assert "<script>alert" not in items
