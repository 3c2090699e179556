"""Job events as they travel through the outbox: one builder per event type.

The dicts built here are the outbox ``payload`` (jsonb) and, encoded by calmq.codec, the
Kafka message value; their fields are the Avro schemas' fields in schemas/. A builder reads
the job's fields by name from a record (calmq.data's ``Job``, ``NewJob``) or a row (a
mapping), so ``requested`` needs no edit when the job and its schema gain a field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from functools import cache
from operator import attrgetter
from pathlib import Path
from typing import Any

__all__ = ["dead_lettered", "requested", "result"]

_SCHEMAS = Path(__file__).parent / "schemas"


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)


def _ms(value: datetime | None) -> int | None:
    """Epoch milliseconds, truncated: the rule insert_job's SQL applies (floor) too.

    Integer arithmetic on the timedelta, not ``timestamp() * 1000``: no float on the way."""
    return None if value is None else (value.astimezone(UTC) - _EPOCH) // _ONE_MS


def _now_ms() -> int:
    return int(time.time() * 1000)


def _reader(job: object) -> Callable[[str], Any]:
    """Field access by name for a record or a row; a field it lacks reads as None."""
    if isinstance(job, Mapping):
        return job.get
    return lambda name: getattr(job, name, None)


@cache
def _requested_fields() -> tuple[tuple[str, ...], tuple[str, ...], attrgetter[Any]]:
    """The newest ``job.requested`` schema's fields after ``event_id``, the job fields they
    are read from (``job_id`` is the job's ``id``), and a getter of those, built once."""
    folder = _SCHEMAS / "job_requested"
    newest = max(folder.glob("v*.avsc"), key=lambda p: int(p.stem[1:]))
    names = tuple(f["name"] for f in json.loads(newest.read_text("utf-8"))["fields"]
                  if f["name"] != "event_id")
    sources = tuple("id" if name == "job_id" else name for name in names)
    return names, sources, attrgetter(*sources)


def requested(job: object, *, attempt: int | None = None) -> dict[str, Any]:
    """``job.requested`` for a job (``attempt``: the one it asks for, default the job's).

    Every field of the schema is the job's field of that name (``job_id`` is its ``id``):
    ids as strings, times as epoch milliseconds.
    """
    names, sources, getter = _requested_fields()
    # A record (the hot path: every accept, claim and retry) in one C call; a row by key.
    values = (tuple(job.get(s) for s in sources) if isinstance(job, Mapping)
              else getter(job))
    event: dict[str, Any] = {"event_id": str(uuid.uuid4())}
    for name, value in zip(names, values, strict=True):
        if isinstance(value, uuid.UUID):
            event[name] = str(value)
        elif isinstance(value, datetime):
            event[name] = _ms(value)
        else:
            event[name] = value
    if attempt is not None:
        event["attempt"] = attempt
    if event.get("created_at") is None:  # a new job: insert_job puts the commit time in
        event["created_at"] = _now_ms()
    return event


def _metadata(get: Callable[[str], Any]) -> str | None:
    """The submit's metadata as JSON text (Avro has no "any JSON" type); None when empty."""
    value = get("metadata")
    return json.dumps(value, separators=(",", ":"), sort_keys=True) if value else None


def _parent(get: Callable[[str], Any]) -> str | None:
    """The job's parent (a child job, calmq.data.children) when the record carries it; the
    attempts' finishing statement (finish_attempts) fills it in from the job row."""
    value = get("parent_id")
    return str(value) if value is not None else None


def _usage(get: Callable[[str], Any]) -> dict[str, Any] | None:
    """The job's usage totals when the record carries them. The attempts' finishing
    statement (finish_attempts) overwrites this with the totals it has just written."""
    tokens_in, tokens_out, cost = get("input_tokens"), get("output_tokens"), get("cost_usd")
    if tokens_in is None or tokens_out is None or cost is None:
        return None
    return {"input_tokens": int(tokens_in), "output_tokens": int(tokens_out),
            "cost_usd": float(cost), "lane": "online"}


def result(
    job: object,
    status: str,
    *,
    artifact: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``job.result``: the job reached a terminal status."""
    get = _reader(job)
    return {
        "event_id": str(uuid.uuid4()),
        "job_id": str(get("id")),
        "tenant_id": str(get("tenant_id")),
        "workflow": get("workflow"),
        "status": status,
        "step": get("step"),
        "attempt": get("attempt"),
        "artifact": artifact,
        "error": error,
        "at": _now_ms(),
        "metadata": _metadata(get),
        "workflow_version": get("workflow_version"),
        "usage": _usage(get),
        "parent_id": _parent(get),
    }


def dead_lettered(
    job: object | None,
    *,
    errors: list[dict[str, Any]] | None = None,
    last_event: str | None = None,
    source_topic: str | None = None,
    raw_value: bytes | None = None,
) -> dict[str, Any]:
    """``job.dead_lettered``; for a job, finish_attempts fills ``errors`` with every attempt's
    error. ``job`` None: a message that names no readable job."""
    get = _reader(job) if job is not None else None
    return {
        "event_id": str(uuid.uuid4()),
        "job_id": str(get("id")) if get else None,
        "tenant_id": str(get("tenant_id")) if get else None,
        "workflow": get("workflow") if get else None,
        "step": get("step") if get else None,
        "attempt": get("attempt") if get else 0,
        "errors": errors or [],
        "last_event": last_event,
        "source_topic": source_topic,
        # jsonb cannot hold bytes: the relay's codec writes Avro bytes from a latin-1 string.
        "raw_value": raw_value.decode("latin-1") if raw_value is not None else None,
        "at": _now_ms(),
        "metadata": _metadata(get) if get else None,
        "workflow_version": get("workflow_version") if get else None,
        "usage": _usage(get) if get else None,
        "parent_id": _parent(get) if get else None,
    }
