"""The data layer: every read and write calmq makes to PostgreSQL, one module per domain noun.

Only the modules of this package import ``calmq.sql`` (make lint enforces it); each returns
typed records, never bare rows. See docs/explanation/architecture.md.
"""

from __future__ import annotations

from calmq.data import outbox
from calmq.data.database import Connection, Database
from calmq.data.jobs import Job
from calmq.data.outbox import OutboxEntry

__all__ = ["Connection", "Database", "Job", "OutboxEntry", "outbox"]
