"""calmq.storable: text PostgreSQL refuses is found, located and cleaned before a commit."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from calmq.data.attempts import Finish
from calmq.data.outbox import entry
from calmq.limits import trace_parent
from calmq.storable import clean, refused, unstorable, unstorable_outcome


@pytest.mark.parametrize(("value", "found"), [
    ({"summary": "fine é 😀"}, None),
    ({"summary": "a\x00b"}, "a NUL character in output.summary"),
    ({"items": ["ok", {"k": "\ud800"}]}, "a lone surrogate (not valid UTF-8) in output.items[1].k"),
    ({"bad\x00key": 1}, "a NUL character in a key of output"),
    ([1, 2.5, None, True], None),
])
def test_unstorable_names_the_place(value: object, found: str | None) -> None:
    """A NUL or a lone surrogate anywhere in a JSON value is found and its place named."""
    assert unstorable(value, "output") == found


def test_clean_replaces_only_what_postgresql_refuses() -> None:
    """clean() turns NULs and lone surrogates into U+FFFD and keeps every other character."""
    assert clean("a\x00b\ud800c😀é") == "a\ufffdb\ufffdc😀é"
    assert clean("plain") == "plain"


def test_an_outcome_with_nul_in_its_recorded_output_or_event_is_unstorable() -> None:
    """Every part of an outcome that is committed is checked: detail, record, outbox."""
    job = uuid.uuid4()
    base = {"job_id": job, "worker": "w", "step": "s", "attempt": 1, "status": "completed",
            "event_type": "completed", "outcome": "completed"}
    assert unstorable_outcome(Finish(**base, event_detail={"x": "ok"})) is None
    assert "event detail" in str(unstorable_outcome(
        Finish(**base, event_detail={"output": {"text": "\x00"}})))
    assert "output" in str(unstorable_outcome(
        Finish(**base, record={"state": "done", "output": {"text": "a\x00"}})))
    payload = {"event_id": str(uuid.uuid4()), "error": {"message": "\ud800"}}
    assert "job.result event" in str(unstorable_outcome(
        Finish(**base, outbox=[entry("results", "job.result", payload, key=job)])))


def test_refused_tells_the_datas_fault_from_the_databases() -> None:
    """Data exceptions and encoding errors split a group; a lost connection does not."""
    assert refused(psycopg.errors.UntranslatableCharacter("\\u0000"))
    assert refused(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
    assert not refused(psycopg.OperationalError("server closed the connection"))
    assert not refused(psycopg.errors.ForeignKeyViolation("no such tenant"))


@pytest.mark.parametrize(("header", "kept"), [
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", True),
    ("00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01", False),  # uppercase
    ("00-00000000000000000000000000000000-b7ad6b7169203331-01", False),  # zero trace id
    ("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", False),  # zero parent id
    ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", False),  # version ff
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x", False),  # 00 has 4 fields
    ("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x", True),  # a later version
    ("00-zz", False),
    ("\x00" * 10, False),
])
def test_only_w3c_traceparents_are_kept(header: str, kept: bool) -> None:
    """A traceparent is stored (and sent to the provider) only in the W3C format."""
    assert (trace_parent(header) is not None) is kept
