"""What a tenant reads of an error names no internal host (producers.problems.hide_hosts)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from calmq.data import HistoryEvent
from calmq.producers.problems import hide_hosts, problem
from calmq.producers.views import event_view, public_error


@pytest.mark.parametrize(("text", "hidden"), [
    ("cannot reach the provider: Cannot connect to host llm-gw.corp:8443 ssl:default "
     "[Connect call failed ('10.1.2.3', 8443)]", ("llm-gw.corp", "10.1.2.3")),
    ('connection to server at "db-1.prod" (10.0.0.5), port 5432 failed', ("db-1.prod",
                                                                          "10.0.0.5")),
    ("Cannot connect to host [fd00::17]:443 ssl:default", ("fd00::17",)),
    ("GET http://user:secret@minio.svc:9000/bucket/x failed", ("minio.svc", "secret")),
    ("could not connect: host=pg-primary port=5432", ("pg-primary",)),
    ("Cannot connect to host postgres:5432", ("postgres",)),
])
def test_hosts_addresses_and_urls_are_hidden(text: str, hidden: tuple[str, ...]) -> None:
    """Host names, IP addresses and URLs in a message become <internal>."""
    shown = hide_hosts(text)
    assert "<internal>" in shown
    for name in hidden:
        assert name not in shown, shown


@pytest.mark.parametrize("text", [
    "step summarize output does not fit SummaryOutput: Input should be a valid string",
    "the body is over the 1048576 byte limit",
    "the provider answered 429: slow down; retry at 10:30",
    "the number 1e999 is beyond the range of a double-precision number",
])
def test_ordinary_messages_are_kept(text: str) -> None:
    """A message without an address is left as it is."""
    assert hide_hosts(text) == text


def test_problem_details_and_job_errors_hide_hosts() -> None:
    """A problem's detail, a job error's message and an event's message hide the host."""
    body = json.loads(problem(503, "object_store_unavailable",
                              "cannot reach http://minio.internal:9000").text or "{}")
    assert "minio.internal" not in body["detail"]
    error = {"code": "connection_error", "class": "transient",
             "message": "Cannot connect to host llm.internal:443 ssl:default"}
    assert "llm.internal" not in public_error(error)["message"]
    assert public_error(error)["code"] == "connection_error"
    assert error["message"].startswith("Cannot connect to host llm.internal")  # a copy
    event = HistoryEvent(id=1, type="retry_scheduled", at=datetime.now(UTC), attempt=1,
                         detail={**error, "delay_seconds": 1.0})
    assert "llm.internal" not in str(event_view(event))
