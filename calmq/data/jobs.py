"""Jobs: the typed job record and the queries that create, claim, move and read jobs."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

__all__ = ["Job"]


@dataclass(slots=True)
class Job:
    """A job as a worker holds it: the columns ``claim_jobs`` returns.

    ``old_status`` is the status the claim found (``running`` means its lease had expired
    and the job was taken over from a dead worker).
    """

    id: uuid.UUID
    tenant_id: uuid.UUID
    workflow: str
    workflow_version: int
    priority: str
    pool: str
    step: str
    attempt: int
    max_attempts: int
    input: dict[str, Any] | None
    input_ref: str | None
    metadata: dict[str, Any]
    deadline_at: datetime | None
    trace_parent: str | None
    created_at: datetime
    old_status: str

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Job:
        """The record of one ``claim_jobs`` (or ``reap_expired_leases``) row.

        The queries return exactly these columns, so this is a plain keyword call: no
        per-field work on the hot path.
        """
        return cls(**row)
