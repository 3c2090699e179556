"""Cost per accepted job: what a job that ended accepted (completed) cost in all, every
attempt of every step included (retries, the calls before a review, the models a fallback
moved to), per workflow and tenant.

Counted where a job completes: a worker's group commit of outcomes (online and batch lane)
and a review's approval (API or review timer). Beside the cost per job
(``calmq_job_cost_usd_total`` / ``calmq_job_cost_jobs_total``, which spreads what failed jobs
cost over every ended job), ``calmq_job_accepted_cost_usd_total`` /
``calmq_job_accepted_jobs_total`` is what one accepted job costs. ``calmq costs`` and the
console show both from the database.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from functools import cache

from prometheus_client import Counter

__all__ = ["Accepted", "count_accepted"]


@dataclass(frozen=True, slots=True)
class Accepted:
    """A job that has just ended accepted, with its whole cost."""

    job_id: uuid.UUID
    workflow: str
    tenant_id: uuid.UUID
    cost_usd: float | Decimal


@cache
def _counters() -> tuple[Counter, Counter]:
    # Created on first use: only processes that complete jobs have them.
    return (
        Counter("calmq_job_accepted_cost_usd_total",
                "Model cost in USD of jobs that ended accepted (completed), each job's every "
                "attempt, retry, review and fallback included",
                ["workflow", "tenant"]),
        Counter("calmq_job_accepted_jobs_total",
                "Jobs that ended accepted (completed): the denominator of the cost per "
                "accepted job", ["workflow", "tenant"]),
    )


def count_accepted(jobs: Iterable[Accepted]) -> None:
    """Count jobs that have just ended accepted (once each: after their move committed)."""
    cost, count = _counters()
    for job in jobs:
        tenant = str(job.tenant_id)
        cost.labels(job.workflow, tenant).inc(max(0.0, float(job.cost_usd)))
        count.labels(job.workflow, tenant).inc()
