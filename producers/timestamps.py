"""The API's one way to read a time from a request and to write one into a response.

Every time the API sends is ISO 8601 (``datetime.isoformat``); every time it reads (query
parameters, the time inside a list cursor) goes through ``parse_time``, so the two cannot
disagree about the format.
"""

from __future__ import annotations

from datetime import datetime

from calmq.errors import ContractError

__all__ = ["format_time", "parse_time"]


def format_time(value: datetime | None) -> str | None:
    """A response's time: ISO 8601 with its offset, or None."""
    return value.isoformat() if value is not None else None


def parse_time(
    name: str, text: str | None, *, zone_required: bool = True, status: int = 400,
    code: str = "invalid_query",
) -> datetime | None:
    """The time in ``text`` (None when absent); ContractError ``code`` when it is not one.

    ``zone_required`` and ``status`` keep each endpoint's documented answer: the job list
    refuses a time without a zone with 400, the dead-letter list reads it in the database's
    zone and answers 422 (docs/reference/api.md).
    """
    if text is None:
        return None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ContractError(f"{name} is not an ISO 8601 time", code=code,
                            status=status) from exc
    if zone_required and parsed.tzinfo is None:
        raise ContractError(f"{name} needs a time zone (e.g. Z or +00:00)", code=code,
                            status=status)
    return parsed
