"""How a stored record or row becomes a response body, in the shapes of producers.models.

Plain dicts on purpose (see producers.models); every time goes through
``timestamps.format_time``. Jobs come as calmq.data records (``JobSnapshot``, ``JobDetail``).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from calmq.data import HistoryEvent, JobDetail, JobSnapshot
from calmq.data.deadletters import DeadLetter
from calmq.data.reviews import PendingReview
from calmq.producers.models import JobSummary
from calmq.producers.timestamps import format_time

__all__ = ["dead_letter_item", "event_view", "job_summary", "job_view", "review_item"]


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return format_time(value)
    return str(value) if isinstance(value, uuid.UUID) else value


# The summary's fields, read from the record by name (the model's ``job_id`` is the record's
# ``id``): a new field of the answer is declared in producers.models and the record only.
_SUMMARY = tuple(("id" if name == "job_id" else name, name) for name in JobSummary.model_fields)


def job_summary(job: JobSnapshot) -> dict[str, Any]:
    """``models.JobSummary`` of a job."""
    return {name: _plain(getattr(job, attr)) for attr, name in _SUMMARY}


def event_view(event: HistoryEvent) -> dict[str, Any]:
    """``models.JobEvent`` of a history entry."""
    return {"type": event.type, "at": format_time(event.at), "attempt": event.attempt,
            "detail": event.detail}


def job_view(job: JobDetail) -> dict[str, Any]:
    """``models.JobView``: the stable shape of GET /v1/jobs/{id} (docs/reference/api.md)."""
    return {**job_summary(job), "usage": _usage(job), "waiting_reason": job.waiting_reason,
            "events": [event_view(e) for e in job.events]}


def _usage(job: JobDetail) -> dict[str, Any]:
    return {"input_tokens": int(job.input_tokens or 0),
            "output_tokens": int(job.output_tokens or 0),
            "cost_usd": float(job.cost_usd or 0)}


def review_item(review: PendingReview) -> dict[str, Any]:
    """``models.ReviewItem`` of a job awaiting review."""
    return {"job_id": str(review.id), "workflow": review.workflow, "step": review.step,
            "confidence": review.confidence, "output": review.output,
            "requested_at": format_time(review.updated_at),
            "deadline_at": format_time(review.review_deadline_at),
            "review_url": f"/v1/jobs/{review.id}/review"}


def dead_letter_item(dead: DeadLetter) -> dict[str, Any]:
    """``models.DeadLetter`` of a dead-lettered job."""
    return {"job_id": str(dead.id), "workflow": dead.workflow, "step": dead.step,
            "attempt": dead.attempt, "error": dead.error,
            "created_at": format_time(dead.created_at),
            "dead_lettered_at": format_time(dead.dead_lettered_at),
            "redrive_url": f"/v1/dead-letters/{dead.id}/redrive"}
