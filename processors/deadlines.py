"""What an attempt's event says of its job's deadline and its calls' service tiers.

The attempt's event in the job's history carries its model calls' tiers (``tiers``: each
call's chosen and served tier, and a flex call's move to the standard tier,
calmq.calls.tiers), and, for a job that ends past its ``deadline_seconds`` (completed late,
or dead-lettered as ``deadline_exceeded``), ``deadline_missed``: when the deadline was and
how late the job ended. Those jobs are counted in ``calmq_deadlines_missed_total``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from calmq.calls.wires import ModelClock
from calmq.data import Finish, Job
from calmq.jobs import Status
from calmq.processors import metrics

__all__ = ["note_deadline_and_tiers"]

_ENDED = (Status.COMPLETED, Status.DEAD_LETTER)


def note_deadline_and_tiers(job: Job, finish: Finish, clock: ModelClock,
                            now: datetime | None = None) -> None:
    """Add the attempt's call tiers and a missed deadline to ``finish``'s event detail."""
    added: dict[str, Any] = {}
    if clock.tiers:
        added["tiers"] = list(clock.tiers)
    deadline = job.deadline_at
    ended = finish.status in _ENDED
    if deadline is not None and ended:
        late = ((now or datetime.now(UTC)) - deadline).total_seconds()
        code = (finish.error or {}).get("code")
        if late > 0 or code == "deadline_exceeded":
            added["deadline_missed"] = {"deadline_at": deadline.isoformat(),
                                        "late_seconds": round(max(late, 0.0), 3)}
            metrics.DEADLINES_MISSED.labels(job.workflow, job.priority,
                                            str(finish.status)).inc()
    if added:
        finish.event_detail = {**finish.event_detail, **added}
