"""Event times: epoch milliseconds truncated, the same rule in Python and in SQL."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

from calmq import events

_QUERIES = Path(__file__).resolve().parents[2] / "calmq" / "sql" / "jobs.sql"


def test_python_truncates_to_the_millisecond() -> None:
    """0.9995 s past a second stays in that millisecond: 999, not rounded up to the next."""
    at = datetime(2026, 12, 1, 21, 0, 0, 999_500, tzinfo=UTC)
    assert events._ms(at) == int(datetime(2026, 12, 1, 21, 0, 0, tzinfo=UTC)
                                 .timestamp()) * 1000 + 999


def test_sql_created_at_is_floored_not_rounded() -> None:
    """Every epoch-ms created_at in jobs.sql goes through floor(), as events._ms truncates."""
    text = _QUERIES.read_text()
    conversions = re.findall(r"(\w*)\(extract\(epoch FROM [\w.]*created_at\) \* 1000\)::bigint",
                             text)
    assert conversions  # insert_job and insert_jobs
    assert set(conversions) == {"floor"}
