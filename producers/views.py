"""How a stored record or row becomes a response body, in the shapes of producers.models.

Plain dicts on purpose (see producers.models); every time goes through
``timestamps.format_time``. Jobs come as calmq.data records (``JobSnapshot``, ``JobDetail``).
Error messages (a job's error, the messages in its history) go through
``problems.hide_hosts``: a tenant reads no internal host name (the row keeps the text).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from calmq.data import HistoryEvent, JobDetail, JobSnapshot
from calmq.data.deadletters import DeadLetter
from calmq.data.reviews import PendingReview
from calmq.producers.models import JobSummary
from calmq.producers.problems import hide_hosts
from calmq.producers.timestamps import format_time

__all__ = ["dead_letter_item", "event_view", "job_summary", "job_view", "public_error",
           "review_item"]


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return format_time(value)
    return str(value) if isinstance(value, uuid.UUID) else value


# The summary's fields, read from the record by name (the model's ``job_id`` is the record's
# ``id``): a new field of the answer is declared in producers.models and the record only.
_SUMMARY = tuple(("id" if name == "job_id" else name, name) for name in JobSummary.model_fields)


def public_error(error: Any) -> Any:
    """An error (``{code, class, message}``) or event detail as a tenant may read it: its
    ``message`` (and a nested ``error``'s) with no internal host name."""
    if not isinstance(error, dict):
        return error
    shown = dict(error)
    if isinstance(shown.get("message"), str):
        shown["message"] = hide_hosts(shown["message"])
    if isinstance(shown.get("error"), str):
        shown["error"] = hide_hosts(shown["error"])
    elif isinstance(shown.get("error"), dict):
        shown["error"] = public_error(shown["error"])
    return shown


def job_summary(job: JobSnapshot) -> dict[str, Any]:
    """``models.JobSummary`` of a job."""
    summary = {name: _plain(getattr(job, attr)) for attr, name in _SUMMARY}
    if "error" in summary:
        summary["error"] = public_error(summary["error"])
    return summary


def event_view(event: HistoryEvent) -> dict[str, Any]:
    """``models.JobEvent`` of a history entry."""
    return {"type": event.type, "at": format_time(event.at), "attempt": event.attempt,
            "detail": public_error(event.detail)}


def job_view(job: JobDetail) -> dict[str, Any]:
    """``models.JobView``: the stable shape of GET /v1/jobs/{id} (docs/reference/api.md)."""
    return {**job_summary(job), "usage": _usage(job), "waiting_reason": job.waiting_reason,
            "parent_id": _plain(job.parent_id),
            "rerun_of": _plain(job.rerun_of), "events": [event_view(e) for e in job.events]}


def _usage(job: JobDetail) -> dict[str, Any]:
    return {"input_tokens": int(job.input_tokens or 0),
            "output_tokens": int(job.output_tokens or 0),
            "cost_usd": float(job.cost_usd or 0),
            "cached_input_tokens": int(job.cached_input_tokens or 0),
            "cache_write_tokens": int(job.cache_write_tokens or 0),
            "cache_saved_usd": float(job.cache_saved_usd or 0)}


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
            "attempt": dead.attempt, "error": public_error(dead.error),
            "created_at": format_time(dead.created_at),
            "dead_lettered_at": format_time(dead.dead_lettered_at),
            "redrive_url": f"/v1/dead-letters/{dead.id}/redrive"}
