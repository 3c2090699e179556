"""The one object a process holds: its Database plus the data-layer class of each noun.

``Store(url)`` is a ``Database`` (``open``, ``close``, ``pool``, ``q``), so code written
against a Database takes it as is, and one attribute per noun runs that noun's queries::

    store = Store(settings.database_url)
    await store.open()
    jobs = await store.jobs.claim(ids, worker, lease_seconds)
    await store.attempts.finish(finishes)
    tenant = await store.tenants.for_key(key)
"""

from __future__ import annotations

from calmq.data.attempts import Attempts
from calmq.data.batches import Batches
from calmq.data.children import Children
from calmq.data.database import KEEP_ERRORS, Database
from calmq.data.jobs import Jobs
from calmq.data.outputs import Outputs
from calmq.data.tenants import Tenants

__all__ = ["Store"]


class Store(Database):
    """One pool, and the queries of each noun on it."""

    def __init__(self, database_url: str, *, min_size: int = 1, max_size: int = 8,
                 keep_errors: int = KEEP_ERRORS, prepare: bool = True) -> None:
        super().__init__(database_url, min_size=min_size, max_size=max_size,
                         keep_errors=keep_errors, prepare=prepare)
        self.jobs = Jobs(self)
        self.attempts = Attempts(self)
        self.tenants = Tenants(self)
        self.batches = Batches(self)
        self.outputs = Outputs(self)
        self.children = Children(self)
