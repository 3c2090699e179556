"""A job's event stream (SSE) read line by line, and a streamed step's text in it.

The API sends each history event (``queued``, ``running``, ``completed``, ...) and, for a
streamed step, ``output.delta`` (``text``, ``step``, ``attempt``, ``seq``, ``offset``) and
``reset`` (a new attempt of ``step`` starts over), each with an ``id`` to resume after
(``Last-Event-ID``), and closes the stream with an ``end`` event once the job is final.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["DELTA", "RESET", "Delta", "EventDecoder", "delta"]

DELTA = "output.delta"
RESET = "reset"


@dataclass(frozen=True, slots=True)
class Delta:
    """A piece of a streamed step's text, or (``reset``: True, no text) word that a new
    attempt of ``step`` starts over: drop what that step's pieces gave so far. ``offset``:
    where ``text`` starts in the attempt's text (each piece starts where the one before
    ended). ``id`` is the event's id, to resume after."""

    text: str
    step: str
    attempt: int
    reset: bool
    offset: int
    id: str


class EventDecoder:
    """Lines in, events out. ``ended``: the API sent ``end`` (the job is final)."""

    def __init__(self) -> None:
        self._fields: dict[str, str] = {}
        self.ended = False

    def feed(self, line: str) -> dict[str, Any] | None:
        """The event that ``line`` completes, if any: a dict with ``id`` and ``type`` and the
        event's data."""
        if line:
            if not line.startswith(":"):  # a comment is a keep-alive
                name, _, value = line.partition(":")
                self._fields[name] = value.removeprefix(" ")
            return None
        fields, self._fields = self._fields, {}
        if fields.get("event") == "end":
            self.ended = True
            return None
        if "data" not in fields:
            return None
        data = json.loads(fields["data"])
        return {"id": fields.get("id"), "type": data.get("type", fields.get("event")), **data}


def delta(event: dict[str, Any], step: str | None) -> Delta | None:
    """The event as a piece of text (of ``step``, or of any step), or None."""
    kind = event.get("type")
    if kind not in (DELTA, RESET) or (step is not None and event.get("step") != step):
        return None
    return Delta(text=str(event.get("text", "")) if kind == DELTA else "",
                 step=str(event.get("step")), attempt=int(event.get("attempt") or 0),
                 reset=kind == RESET, offset=int(event.get("offset") or 0),
                 id=str(event.get("id")))
