"""The data layer: every read and write calmq makes to PostgreSQL, one module per domain noun.

Only the modules of this package import ``calmq.sql`` (make lint enforces it); each returns
typed records, never bare rows. A process holds one ``Store`` (calmq.data.store): a
``Database`` with one attribute per noun (``store.jobs``, ``store.attempts``,
``store.tenants``). Functions that take the caller's own connection (``insert_job``,
``outbox.insert``) serve code that writes inside a transaction it owns. See
docs/explanation/architecture.md.
"""

from __future__ import annotations

from calmq.data import outbox
from calmq.data.attempts import Attempts, Finish
from calmq.data.database import Connection, Database
from calmq.data.jobs import (
    HistoryEvent,
    Idempotency,
    Job,
    JobDetail,
    JobFilter,
    Jobs,
    JobSearch,
    JobSnapshot,
    NewJob,
    TenantJob,
    insert_job,
    insert_job_sync,
    insert_jobs,
)
from calmq.data.outbox import OutboxEntry
from calmq.data.store import Store
from calmq.data.tenants import Tenant, Tenants

__all__ = [
    "Attempts",
    "Connection",
    "Database",
    "Finish",
    "HistoryEvent",
    "Idempotency",
    "Job",
    "JobDetail",
    "JobFilter",
    "JobSearch",
    "JobSnapshot",
    "Jobs",
    "NewJob",
    "OutboxEntry",
    "Store",
    "Tenant",
    "TenantJob",
    "Tenants",
    "insert_job",
    "insert_job_sync",
    "insert_jobs",
    "outbox",
]
