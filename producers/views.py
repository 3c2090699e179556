"""How a stored record or row becomes a response body, in the shapes of producers.models.

Plain dicts on purpose (see producers.models); every time goes through
``timestamps.format_time``. Jobs come as calmq.data records (``JobSnapshot``, ``JobDetail``).
"""

from __future__ import annotations

from typing import Any

from calmq.data import HistoryEvent, JobDetail, JobSnapshot
from calmq.producers.timestamps import format_time

__all__ = ["dead_letter_item", "event_view", "job_summary", "job_view", "review_item"]


def job_summary(job: JobSnapshot) -> dict[str, Any]:
    """``models.JobSummary`` of a job."""
    return {
        "job_id": str(job.id),
        "workflow": job.workflow,
        "status": job.status,
        "attempt": job.attempt,
        "step": job.step,
        "artifact": job.artifact,
        "error": job.error,
        "created_at": format_time(job.created_at),
        "updated_at": format_time(job.updated_at),
    }


def event_view(event: HistoryEvent) -> dict[str, Any]:
    """``models.JobEvent`` of a history entry."""
    return {"type": event.type, "at": format_time(event.at), "attempt": event.attempt,
            "detail": event.detail}


def job_view(job: JobDetail) -> dict[str, Any]:
    """``models.JobView``: the stable shape of GET /v1/jobs/{id} (DESIGN.md §4)."""
    return {**job_summary(job), "usage": _usage(job),
            "events": [event_view(e) for e in job.events]}


def _usage(job: JobDetail) -> dict[str, Any]:
    return {"input_tokens": int(job.input_tokens or 0),
            "output_tokens": int(job.output_tokens or 0),
            "cost_usd": float(job.cost_usd or 0)}


def review_item(row: dict[str, Any]) -> dict[str, Any]:
    """``models.ReviewItem`` of a job awaiting review."""
    return {"job_id": str(row["id"]), "workflow": row["workflow"], "step": row["step"],
            "confidence": row["confidence"], "output": row["output"],
            "requested_at": format_time(row["updated_at"]),
            "deadline_at": format_time(row["review_deadline_at"]),
            "review_url": f"/v1/jobs/{row['id']}/review"}


def dead_letter_item(row: dict[str, Any]) -> dict[str, Any]:
    """``models.DeadLetter`` of a dead-lettered job."""
    return {"job_id": str(row["id"]), "workflow": row["workflow"], "step": row["step"],
            "attempt": row["attempt"], "error": row["error"],
            "created_at": format_time(row["created_at"]),
            "dead_lettered_at": format_time(row["dead_lettered_at"]),
            "redrive_url": f"/v1/dead-letters/{row['id']}/redrive"}
