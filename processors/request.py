"""A polled ``job.requested`` message as the stages after intake see it.

Kept free of the Kafka client: admission and claim decide on the job's id, step, tenant
and priority, and hand the message itself back only as an opaque value (a deferral
resubmits it). ``Position`` is where the message sits: what its offset is marked done by.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["Position", "Request"]

Position = tuple[tuple[str, int], int]  # ((topic, partition), offset)


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded job.requested: which job, at which step, whose and how urgent."""

    position: Position
    job_id: uuid.UUID
    step: str
    workflow: str
    tenant: str  # the tenant's id as the event carries it ("" when it does not)
    priority: str
    message: Any  # the Kafka message, passed back as it came (resubmitted after a deferral)

    @property
    def from_room(self) -> bool:
        """A job the pipeline took from a waiting room (fair share): no message carries it,
        and its position names no partition (marking it done commits nothing)."""
        return self.position[0][1] < 0

    @property
    def topic(self) -> str:
        return self.position[0][0]

    @property
    def tenant_id(self) -> uuid.UUID | None:
        try:
            return uuid.UUID(self.tenant)
        except ValueError:
            return None
