"""Times on the command line: the filters' ``--since``, ``--until``, ``--created-after``, ..."""

from __future__ import annotations

from datetime import UTC, datetime

from calmq.errors import ConfigError, UsageError

__all__ = ["when"]


def when(text: str | None) -> datetime | None:
    """An ISO time (UTC when it names no zone), or a duration ago (``90m``, ``2h``)."""
    from datetime import timedelta

    from calmq.settings import parse_duration

    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        try:
            return datetime.now(UTC) - timedelta(seconds=parse_duration(text))
        except (ValueError, ConfigError):
            raise UsageError(f"{text!r} is neither an ISO time nor a duration like 2h",
                             code="invalid_time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
