"""One root, two groups: the API answered no, or the API could not be heard."""

from __future__ import annotations

__all__ = ["ApiError", "ClientError", "ConnectionFailed", "OutcomeUnknown"]


class ClientError(Exception):
    """Root of every error calmq-client raises."""


class ApiError(ClientError):
    """A problem+json answer of the API: ``status``, its stable ``code``, ``detail`` (also
    ``message``), ``title`` and ``type``; ``retry_after``, the seconds the API asked to wait
    (its ``Retry-After``), if any."""

    def __init__(self, status: int, code: str, detail: str, *, title: str | None = None,
                 type: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.message = detail  # the name calmq's own errors use
        self.title = title
        self.type = type
        self.retry_after = retry_after

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.detail}"


class ConnectionFailed(ClientError):
    """The API could not be reached, or the connection broke, and trying again did not help
    (or was not safe). The transport's own error is the ``__cause__``."""


class OutcomeUnknown(ConnectionFailed):
    """A call that is not safe to repeat (a submit without an idempotency key, a cancel, a
    delete) was sent and its answer lost: it may or may not have taken effect. A submit
    with ``idempotency_key`` is repeated instead, and answered with the same job."""
