"""The one error hierarchy of calmq.

Every error a person can act on carries a stable ``code`` (what API clients and the CLI
match on) and, where it ends a job, a failure ``class`` from the contract. Driver errors
are kept as ``__cause__`` (``raise CalmqError(...) from exc``), never swallowed.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

__all__ = [
    "CalmqError",
    "ConfigError",
    "ContractError",
    "FailureClass",
    "InfrastructureError",
    "LeaseLost",
    "NotFound",
    "StepFailure",
    "UsageError",
]


class FailureClass(StrEnum):
    """Why an attempt failed; decides whether it is retried (only ``transient`` is)."""

    TRANSIENT = "transient"
    INPUT = "input"
    PERMISSION = "permission"
    POLICY = "policy"
    VERIFIER = "verifier"
    DEADLINE = "deadline"
    BUG = "bug"


class CalmqError(Exception):
    """Root of every error calmq raises on purpose."""

    code: ClassVar[str] = "calmq_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code  # type: ignore[misc]  # instance override of the class default


class ConfigError(CalmqError):
    """Settings, flags or environment that calmq cannot use."""

    code = "invalid_setting"


class UsageError(ConfigError):
    """A command line the command cannot use (exit status 2, like argparse's own)."""

    code = "usage"


class ContractError(CalmqError):
    """Input at an entry point (HTTP body, Kafka message, outbox row) that breaks the contract.

    ``status`` is the HTTP status an API answers with when this reaches a handler.
    """

    code = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None, status: int = 400) -> None:
        super().__init__(message, code=code)
        self.status = status


class NotFound(ContractError):
    """A job, tenant or object that does not exist for the caller (also: another tenant's)."""

    code = "not_found"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code, status=404)


class InfrastructureError(CalmqError):
    """A real part (Kafka, PostgreSQL, the object store, a binary) failed or cannot start."""

    code = "infrastructure_error"


class LeaseLost(CalmqError):
    """The attempt no longer holds its job: a newer claim (another worker's, or the same
    worker id's after a restart), a reaper or a cancel took it. The database refused the
    attempt's write (its fencing token is stale); the attempt ends with no outcome."""

    code = "lease_lost"


class StepFailure(CalmqError):
    """An attempt of a workflow step failed; ``failure_class`` routes it (retry, dead letter).

    ``retry_after`` is the provider's own Retry-After in seconds, a floor for the next delay.
    """

    code = "step_failed"

    def __init__(
        self,
        message: str,
        *,
        code: str,
        failure_class: FailureClass,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.failure_class = failure_class
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        return self.failure_class is FailureClass.TRANSIENT
