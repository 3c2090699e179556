"""Structured logs: one JSON object per line, correlated by job id, attempt and trace id.

The step runner binds a job's id, attempt and trace id to the task running the attempt
(``bind``); every record logged in that task -- by the runner, the gateway, the budget --
carries them, because each attempt runs in its own asyncio task with its own context.
Input fields a record carries (``extra={"input": ...}``) are redacted per
``CALMQ_LOG_REDACT_FIELDS``: ``*`` (all of them, the default), a comma list of field names,
or empty (none). Documented in docs/how-to/observability.md.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

__all__ = ["REDACTED", "JsonFormatter", "bind", "bound", "configure", "trace_id"]

REDACTED = "[redacted]"

_CONTEXT: ContextVar[dict[str, Any] | None] = ContextVar("calmq_log_context", default=None)

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}


def trace_id(traceparent: str | None) -> str | None:
    """The 32-hex trace id of a W3C ``traceparent`` (``00-<trace>-<span>-<flags>``)."""
    if not traceparent:
        return None
    parts = traceparent.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32:
        return None
    return parts[1].lower()


def bind(**fields: Any) -> None:
    """Attach ``fields`` to every record logged from the current task (or thread) on."""
    _CONTEXT.set({**(_CONTEXT.get() or {}), **{k: v for k, v in fields.items() if v is not None}})


def bound() -> dict[str, Any]:
    return dict(_CONTEXT.get() or {})


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, bound context, extras."""

    def __init__(self, redact: str = "*") -> None:
        super().__init__()
        names = {n.strip() for n in redact.split(",") if n.strip()}
        self.redact_all = "*" in names
        self.redact = names - {"*"}

    def _redacted(self, value: Any) -> Any:
        if not isinstance(value, dict):
            return REDACTED if self.redact_all else value
        return {k: REDACTED if self.redact_all or k in self.redact else v
                for k, v in value.items()}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "at": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(_CONTEXT.get() or {})
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = self._redacted(value) if key == "input" else value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure(level: str = "INFO", redact: str = "*") -> None:
    """Send the root logger's records to stderr as JSON lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(redact))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level, logging.INFO))
