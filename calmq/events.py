"""Job events as they travel through the outbox: one builder per event type.

The dicts built here are the outbox ``payload`` (jsonb) and, encoded by calmq.codec, the
Kafka message value; their fields are the Avro schemas' fields in schemas/.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime
from typing import Any

__all__ = ["dead_lettered", "outbox_entry", "requested", "result"]


def _ms(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp() * 1000)


def _now_ms() -> int:
    return int(time.time() * 1000)


def requested(job: dict[str, Any], *, attempt: int | None = None) -> dict[str, Any]:
    """``job.requested`` for a job row (or the same fields of a new job)."""
    return {
        "event_id": str(uuid.uuid4()),
        "job_id": str(job["id"]),
        "tenant_id": str(job["tenant_id"]),
        "workflow": job["workflow"],
        "workflow_version": job["workflow_version"],
        "step": job["step"],
        "attempt": job["attempt"] if attempt is None else attempt,
        "priority": job["priority"],
        "pool": job["pool"],
        "input_ref": job.get("input_ref"),
        "deadline_at": _ms(job.get("deadline_at")),
        "created_at": _ms(job.get("created_at")) or _now_ms(),
        "trace_parent": job.get("trace_parent"),
    }


def result(
    job: dict[str, Any],
    status: str,
    *,
    artifact: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``job.result``: the job reached a terminal status."""
    return {
        "event_id": str(uuid.uuid4()),
        "job_id": str(job["id"]),
        "tenant_id": str(job["tenant_id"]),
        "workflow": job["workflow"],
        "status": status,
        "step": job["step"],
        "attempt": job["attempt"],
        "artifact": artifact,
        "error": error,
        "at": _now_ms(),
    }


def dead_lettered(
    job: dict[str, Any] | None,
    *,
    errors: list[dict[str, Any]] | None = None,
    last_event: str | None = None,
    source_topic: str | None = None,
    raw_value: bytes | None = None,
) -> dict[str, Any]:
    """``job.dead_lettered``; for a job the store fills ``errors`` with every attempt's error."""
    return {
        "event_id": str(uuid.uuid4()),
        "job_id": str(job["id"]) if job else None,
        "tenant_id": str(job["tenant_id"]) if job else None,
        "workflow": job["workflow"] if job else None,
        "step": job["step"] if job else None,
        "attempt": job["attempt"] if job else 0,
        "errors": errors or [],
        "last_event": last_event,
        "source_topic": source_topic,
        # jsonb cannot hold bytes: the relay's codec writes Avro bytes from a latin-1 string.
        "raw_value": raw_value.decode("latin-1") if raw_value is not None else None,
        "at": _now_ms(),
    }


def outbox_entry(
    route: str, event_type: str, payload: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """One element of the ``outbox`` list of calmq.store.Finish."""
    return {
        "id": payload["event_id"],
        "route": route,
        "type": event_type,
        "payload": payload,
        "headers": headers or {},
    }
