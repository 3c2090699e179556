"""W3C trace context through a job's attempt, and OpenTelemetry spans when it is installed.

The API stores the request's ``traceparent`` on the job; every outbox row of the job
carries it as a Kafka header. For an attempt the runner enters ``span`` with it: with the
optional ``otel`` extra installed (``pip install 'calmq[otel]'``) that is a real span, child
of the request's trace, and ``current_traceparent`` names the span (so the model call is its
child); without it nothing is recorded and ``current_traceparent`` is the job's own value.
The gateway sends ``current_traceparent`` to the model provider.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Any

__all__ = ["current_traceparent", "otel_available", "span"]

_TRACEPARENT: ContextVar[str | None] = ContextVar("calmq_traceparent", default=None)


@cache
def _otel() -> Any:
    """The opentelemetry modules, or None when the extra is not installed."""
    try:
        from opentelemetry import trace  # type: ignore[import-not-found,unused-ignore]
        from opentelemetry.trace.propagation.tracecontext import (  # type: ignore[import-not-found,unused-ignore]
            TraceContextTextMapPropagator,
        )
    except ImportError:
        return None
    return trace, TraceContextTextMapPropagator()


def otel_available() -> bool:
    return _otel() is not None


def current_traceparent() -> str | None:
    """The traceparent to send downstream from the current task (None outside a job)."""
    return _TRACEPARENT.get()


@contextmanager
def span(name: str, traceparent: str | None, **attributes: str | int) -> Iterator[None]:
    """A span named ``name`` under ``traceparent`` (a no-op without OpenTelemetry)."""
    otel = _otel()
    if otel is None:
        token = _TRACEPARENT.set(traceparent)
        try:
            yield
        finally:
            _TRACEPARENT.reset(token)
        return
    trace, propagator = otel
    parent = propagator.extract({"traceparent": traceparent}) if traceparent else None
    tracer = trace.get_tracer("calmq")
    with tracer.start_as_current_span(name, context=parent, attributes=attributes):
        carrier: dict[str, str] = {}
        propagator.inject(carrier)
        token = _TRACEPARENT.set(carrier.get("traceparent", traceparent))
        try:
            yield
        finally:
            _TRACEPARENT.reset(token)
