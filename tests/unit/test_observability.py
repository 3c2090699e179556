"""JSON logs, their job context and redaction; the trace context without OpenTelemetry."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from calmq import logs, tracing

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("calmq.test", logging.INFO, __file__, 1, message, args, None)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_a_message_with_quotes_is_one_valid_json_line() -> None:
    """Quotes, backslashes and newlines in a message still give one parseable JSON line."""
    line = logs.JsonFormatter().format(_record('he said "%s"\\\nbye', 'x"y'))
    assert "\n" not in line
    out = json.loads(line)
    assert out["message"] == 'he said "x"y"\\\nbye'
    assert out["level"] == "INFO"
    assert out["logger"] == "calmq.test"


def test_bound_job_context_is_on_records_of_that_task_only() -> None:
    """Fields bound in one asyncio task appear on its records, not on another task's."""
    formatter = logs.JsonFormatter()

    async def attempt(job: str) -> dict[str, object]:
        logs.bind(job_id=job, attempt=2, trace_id=logs.trace_id(TRACEPARENT))
        await asyncio.sleep(0)
        result: dict[str, object] = json.loads(formatter.format(_record("attempt finished")))
        return result

    async def both() -> tuple[dict[str, object], dict[str, object]]:
        return await asyncio.gather(attempt("a"), attempt("b"))

    first, second = asyncio.run(both())
    assert (first["job_id"], second["job_id"]) == ("a", "b")
    assert first["attempt"] == 2
    assert first["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert "job_id" not in json.loads(formatter.format(_record("outside any job")))


@pytest.mark.parametrize(("setting", "expected"), [
    ("*", {"text": logs.REDACTED, "mode": logs.REDACTED}),
    ("text", {"text": logs.REDACTED, "mode": "success"}),
    ("", {"text": "secret invoice", "mode": "success"}),
])
def test_input_fields_are_redacted_per_setting(setting: str, expected: dict[str, str]) -> None:
    """An ``input`` extra shows only what CALMQ_LOG_REDACT_FIELDS lets through."""
    record = _record("step starts", input={"text": "secret invoice", "mode": "success"})
    assert json.loads(logs.JsonFormatter(setting).format(record))["input"] == expected


def test_trace_id_of_a_traceparent() -> None:
    """The trace id is the second field of a W3C traceparent; malformed values give None."""
    assert logs.trace_id(TRACEPARENT) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert logs.trace_id("garbage") is None
    assert logs.trace_id(None) is None


@pytest.mark.skipif(tracing.otel_available(), reason="OpenTelemetry is installed")
def test_without_opentelemetry_a_span_passes_the_jobs_traceparent_on() -> None:
    """With no otel extra, inside a span the downstream traceparent is the job's own."""
    assert tracing.current_traceparent() is None
    with tracing.span("calmq.attempt", TRACEPARENT, **{"calmq.attempt": 1}):
        assert tracing.current_traceparent() == TRACEPARENT
    assert tracing.current_traceparent() is None
