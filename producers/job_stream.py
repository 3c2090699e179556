"""What one follower of a job is sent on ``GET /v1/jobs/{id}/events``: its history events
and its streamed output, in order, from the position it asked for.

The output of a streamed step arrives as ``output.delta`` events (the text, the step, the
attempt, ``seq`` 1, 2, ... and the ``offset`` of the text in the attempt's stream). Each
attempt streams anew: when a later attempt of a step begins after this follower received
some of an earlier one's text, a ``reset`` event says to drop that step's text, and the new
attempt's deltas follow from seq 1. Every event's id is the follower's whole position
(calmq.calls.publishing.Position), so ``Last-Event-ID`` resumes history and output alike, on any
API process. Deltas come from the hub's feed as workers announce them; the table is read
when the stream starts, after a gap, or when the job is final (a final job's deltas are
compacted into one text per step, sent whole, or from the follower's offset on).

Nothing here does I/O: the route (producers/routes/jobs.py) reads and writes.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

from calmq.calls import Position
from calmq.data import HistoryEvent
from calmq.data.outputs import OutputChunk, OutputRead
from calmq.producers.views import event_view

__all__ = ["DELTA", "RESET", "JobStream"]

DELTA = "output.delta"
RESET = "reset"


class JobStream:
    """One follower's position and the events that move it."""

    def __init__(self, job_id: uuid.UUID, position: Position) -> None:
        self.job_id = job_id
        self.position = position
        # The step of the stream the position is in, once known (a position from
        # Last-Event-ID names the stream alone: the table says its step).
        self.step: str | None = None

    def _frame(self, kind: str, data: dict[str, Any]) -> bytes:
        payload = json.dumps({"job_id": str(self.job_id), **data})
        return f"id: {self.position.event_id}\nevent: {kind}\ndata: {payload}\n\n".encode()

    def history(self, rows: list[HistoryEvent]) -> list[bytes]:
        frames = []
        for row in rows:
            self.position = replace(self.position, history=row.id)
            frames.append(self._frame(row.type, event_view(row)))
        return frames

    def _delta(self, c: OutputChunk) -> bytes:
        step, attempt, stream, seq, offset = c.step, c.attempt, c.stream, c.seq, c.offset
        text = c.text or ""
        self.position = replace(self.position, stream=stream, seq=seq,
                                offset=offset + len(text))
        self.step = step
        return self._frame(DELTA, {"type": DELTA, "step": step, "attempt": attempt,
                                   "seq": seq, "offset": offset, "text": text})

    def _reset(self, step: str | None, attempt: int, stream: int) -> bytes:
        self.position = replace(self.position, stream=stream, seq=0, offset=0)
        self.step = step
        return self._frame(RESET, {"type": RESET, "step": step, "attempt": attempt})

    def from_feed(self, chunks: list[OutputChunk]) -> list[bytes] | None:
        """The events of chunks as the hub announced them; None when they do not follow
        on from the position (a gap, a chunk announced without its text, a stream whose
        step is unknown): then the stream reads the table."""
        frames: list[bytes] = []
        for c in chunks:
            pos = self.position
            if (c.stream, c.seq) <= (pos.stream, pos.seq):
                continue  # sent already, or an earlier attempt's (a stale worker's)
            if c.text is None:
                return None
            if c.stream == pos.stream:
                if c.seq != pos.seq + 1:
                    return None
            else:
                if c.seq != 1 or (pos.stream and pos.seq and self.step is None):
                    return None
                if pos.stream and pos.seq and self.step == c.step:
                    # A new attempt of the step whose text this follower has: drop it.
                    frames.append(self._reset(c.step, c.attempt, c.stream))
            frames.append(self._delta(c))
        return frames

    def from_read(self, read: OutputRead) -> list[bytes]:
        """The events of what the table holds after the position."""
        frames: list[bytes] = []
        streams = {s.stream: s for s in read.streams}
        compacted = {c.stream: c for c in read.compacted}
        # Every stream that is its step's latest, by its number: chunks, or compacted.
        current = sorted({s.stream for s in read.streams if s.current} | set(compacted))
        pos = self.position
        if self.step is None and pos.stream in streams:
            self.step = streams[pos.stream].step
        elif self.step is None and pos.stream in compacted:
            self.step = compacted[pos.stream].step
        if pos.stream and pos.seq and pos.stream not in current:
            # The follower's stream was an attempt that a later one replaced.
            info = streams.get(pos.stream)
            step = info.step if info is not None else self.step
            later = [s for s in current if s > pos.stream and (
                step is None or _step_of(s, streams, compacted) == step)]
            if later:
                attempt = _attempt_of(later[0], streams, compacted)
                frames.append(self._reset(step, attempt, later[0]))
        by_stream: dict[int, list[OutputChunk]] = {}
        for chunk in read.chunks:
            by_stream.setdefault(chunk.stream, []).append(chunk)
        for stream in current:
            pos = self.position
            if stream < pos.stream:
                continue
            whole = compacted.get(stream)
            if whole is not None:
                done = pos.seq if stream == pos.stream else 0
                start = pos.offset if stream == pos.stream else 0
                if done < whole.chunks and whole.text[start:]:
                    frames.append(self._delta(OutputChunk(
                        self.job_id, stream, whole.chunks, whole.step, whole.attempt, start,
                        whole.text[start:])))
                continue
            for c in by_stream.get(stream, ()):
                if (c.stream, c.seq) > (self.position.stream, self.position.seq):
                    frames.append(self._delta(c))
        return frames


def _step_of(stream: int, streams: dict[int, Any], compacted: dict[int, Any]) -> str:
    found = streams.get(stream) or compacted.get(stream)
    return str(found.step) if found is not None else ""


def _attempt_of(stream: int, streams: dict[int, Any], compacted: dict[int, Any]) -> int:
    found = streams.get(stream) or compacted.get(stream)
    return int(found.attempt) if found is not None else 0
