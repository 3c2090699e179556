"""A streamed step's text on its way to a follower, without I/O: the NOTIFY payloads kept
under PostgreSQL's 8,000 bytes, the position as an SSE event id, what a follower is sent
from the hub's feed and from the table (reset on a new attempt, resumption mid-text, a
compacted final text), and the Prefer: wait header's reading."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest

from calmq.calls.publishing import Position
from calmq.data import HistoryEvent
from calmq.data.outputs import (
    NOTIFY_BYTES,
    CompactedOutput,
    OutputChunk,
    OutputRead,
    StreamInfo,
    parse_payload,
    payloads,
)
from calmq.errors import ContractError
from calmq.producers.job_stream import JobStream
from calmq.producers.routes.jobs import _preferred_wait

JOB = uuid.UUID(int=7)


def _chunk(stream: int, seq: int, offset: int, text: str | None, attempt: int = 1
           ) -> OutputChunk:
    return OutputChunk(JOB, stream, seq, "draft", attempt, offset, text)


def _events(frames: list[bytes]) -> list[tuple[str, str, dict[str, object]]]:
    """(id, event, data) of each SSE frame."""
    found = []
    for frame in frames:
        fields = dict(line.split(": ", 1) for line in frame.decode().strip().split("\n"))
        found.append((fields["id"], fields["event"], json.loads(fields["data"])))
    return found


def test_payloads_stay_under_the_notify_limit_and_carry_every_chunk() -> None:
    """Many chunks are cut into several payloads, each under 8,000 bytes; a chunk too big
    for any payload is announced without its text (the reader reads the row)."""
    chunks = [_chunk(5, n, n * 300, "é" * 300) for n in range(1, 60)]
    chunks.append(_chunk(5, 60, 60 * 300, "x" * 9000))
    found = payloads(chunks)
    assert len(found) > 1
    assert all(len(p.encode()) < NOTIFY_BYTES for p in found)
    parsed = [c for p in found for c in parse_payload(p)]
    assert parsed[:-1] == chunks[:-1]
    assert parsed[-1].text is None
    assert parsed[-1].seq == 60


def test_a_payload_is_filtered_to_the_jobs_followed() -> None:
    """An API process passes on only the chunks of jobs its streams follow."""
    other = OutputChunk(uuid.UUID(int=8), 1, 1, "draft", 1, 0, "other")
    [payload] = payloads([_chunk(1, 1, 0, "mine"), other])
    assert [c.text for c in parse_payload(payload, {str(JOB)})] == ["mine"]


def test_a_position_round_trips_as_an_event_id() -> None:
    """A history id alone before any delta, the whole position after; anything else is
    refused as invalid_header."""
    assert Position(history=12).event_id == "12"
    assert Position.parse("12") == Position(history=12)
    whole = Position(history=12, stream=3, seq=4, offset=99)
    assert Position.parse(whole.event_id) == whole
    for bad in ("x", "1:2", "-1", "1:2:3:-4", ""):
        with pytest.raises(ContractError) as caught:
            Position.parse(bad)
        assert caught.value.code == "invalid_header"


def test_the_feed_gives_deltas_in_order_and_skips_what_was_sent() -> None:
    """Chunks that follow on are sent as deltas; one sent already is not sent again; a gap
    (a missing seq, or a chunk without its text) asks for a table read instead."""
    follower = JobStream(JOB, Position(history=3))
    frames = follower.from_feed([_chunk(9, 1, 0, "one"), _chunk(9, 2, 3, " two")])
    assert frames is not None
    sent = _events(frames)
    assert [(e, d["text"], d["offset"]) for _i, e, d in sent] == [
        ("output.delta", "one", 0), ("output.delta", " two", 3)]
    assert sent[-1][0] == "3:9:2:7"
    assert follower.from_feed([_chunk(9, 2, 3, " two")]) == []
    assert follower.from_feed([_chunk(9, 4, 10, "!")]) is None
    assert follower.from_feed([_chunk(9, 3, 7, None)]) is None


def test_a_new_attempt_of_the_step_is_announced_with_reset() -> None:
    """A later stream of the same step, after some text of an earlier one, is preceded by
    reset; its deltas start again from seq 1."""
    follower = JobStream(JOB, Position(history=3))
    assert follower.from_feed([_chunk(9, 1, 0, "half")])
    frames = follower.from_feed([_chunk(12, 1, 0, "whole", attempt=2)])
    assert frames is not None
    sent = _events(frames)
    assert [e for _i, e, _d in sent] == ["reset", "output.delta"]
    assert sent[0][2] == {"job_id": str(JOB), "type": "reset", "step": "draft", "attempt": 2}
    assert sent[1][0] == "3:12:1:5"
    # A stale worker's chunk of the earlier stream is not passed on.
    assert follower.from_feed([_chunk(9, 2, 4, " more")]) == []


def test_a_resumed_follower_reads_the_rest_from_the_table() -> None:
    """From Last-Event-ID mid-stream, the table's later chunks are the rest of the text."""
    follower = JobStream(JOB, Position.parse("3:9:1:3"))
    read = OutputRead([StreamInfo(9, "draft", 1, 3, True)],
                      [_chunk(9, 2, 3, " two"), _chunk(9, 3, 7, " three")], [])
    sent = _events(follower.from_read(read))
    assert "".join(str(d["text"]) for _i, _e, d in sent) == " two three"
    assert sent[-1][0] == "3:9:3:13"


def test_a_resumed_follower_of_a_replaced_attempt_gets_reset_then_the_new_text() -> None:
    """A follower whose stream a later attempt replaced is told reset, then the later
    stream's text, here compacted once the job was final."""
    follower = JobStream(JOB, Position.parse("3:9:1:4"))
    read = OutputRead([StreamInfo(9, "draft", 1, 2, False)], [],
                      [CompactedOutput(12, "draft", 2, 5, "the whole text")])
    sent = _events(follower.from_read(read))
    assert [e for _i, e, _d in sent] == ["reset", "output.delta"]
    assert sent[1][2]["text"] == "the whole text"


def test_a_compacted_text_resumes_from_the_followers_offset() -> None:
    """A final job's compacted text is sent from the offset the follower reached."""
    follower = JobStream(JOB, Position.parse("3:12:2:4"))
    read = OutputRead([], [], [CompactedOutput(12, "draft", 1, 5, "the whole text")])
    sent = _events(follower.from_read(read))
    assert [(d["offset"], d["text"]) for _i, _e, d in sent] == [(4, "whole text")]


def test_history_events_keep_their_id_before_any_delta() -> None:
    """Without streamed output an event's id is its history id, as before."""
    follower = JobStream(JOB, Position())
    at = datetime(2026, 12, 3, tzinfo=UTC)
    sent = _events(follower.history([HistoryEvent(4, "running", at, 1, {})]))
    assert sent[0][:2] == ("4", "running")


def test_prefer_wait_is_read_as_rfc_7240_says() -> None:
    """wait=N among the preferences, capped by the setting; anything else is ignored."""
    assert _preferred_wait(["wait=5"], 30) == 5
    assert _preferred_wait(["respond-async, wait=100"], 30) == 30
    assert _preferred_wait(['handling=lenient', 'wait="7"'], 30) == 7
    assert _preferred_wait(["wait=abc", "return=minimal"], 30) == 0
    assert _preferred_wait([], 30) == 0
    assert _preferred_wait(["wait=5"], 0) == 0
