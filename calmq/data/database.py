"""The connection pool every data-layer module runs its queries on.

One ``Database`` per process: the noun modules beside this one (jobs, tenants, outbox, …)
take it in their constructor and are the only code that reads ``calmq/sql``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool

from calmq import sql
from calmq.errors import InfrastructureError
from calmq.limits import KEEP_ERRORS

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = ["KEEP_ERRORS", "LISTEN_KEEPALIVES", "Connection", "Database", "listen_connection"]

Connection = psycopg.AsyncConnection[DictRow]

# TCP keepalives (libpq's options) on the sessions that only LISTEN. They send nothing while
# no notification comes, so a server or a path gone without a reset (a NAT or firewall that
# forgot the flow, a host powered off, a failover's old primary) would leave them waiting
# for ever, deaf to every notification, while the process looks healthy. With these the
# kernel probes an idle session after 30 s and gives it up after three unanswered probes
# 10 s apart: the session errors, and its reconnect loop (which wakes every waiter) runs.
LISTEN_KEEPALIVES: dict[str, Any] = {
    "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}


async def listen_connection(url: str) -> psycopg.AsyncConnection[Any]:
    """An autocommit connection for LISTEN, with TCP keepalives (``LISTEN_KEEPALIVES``)."""
    return await psycopg.AsyncConnection.connect(url, autocommit=True, **LISTEN_KEEPALIVES)


class Database:
    """An async pool of autocommit connections whose rows are dicts, and the named queries."""

    def __init__(self, database_url: str, *, min_size: int = 1, max_size: int = 8,
                 keep_errors: int = KEEP_ERRORS, prepare: bool = True) -> None:
        self.url = database_url
        # How many of a job's errors its row keeps (setting max_job_errors): the statements
        # that append one drop the oldest past it (calmq_append_error, migration 0021).
        self.keep_errors = keep_errors
        self.q: Mapping[str, str] = sql.queries()
        # prepare=False behind a transaction pooler (PgBouncer before 1.21, or with
        # max_prepared_statements 0): a statement psycopg prepared on one server connection
        # would be executed on another, which has no such statement.
        self.pool: AsyncConnectionPool[Connection] = AsyncConnectionPool(
            database_url,
            connection_class=Connection,
            min_size=min_size,
            max_size=max_size,
            open=False,
            kwargs={"autocommit": True, "row_factory": dict_row,
                    **({} if prepare else {"prepare_threshold": None})},
        )

    @classmethod
    def pool_options(cls, settings: Settings) -> dict[str, bool]:
        """The pool's options the settings call for (``database_pooler``)."""
        return {"prepare": settings.database_pooler != "transaction"}

    async def open(self) -> None:
        try:
            await self.pool.open(wait=True, timeout=15)
        except psycopg.Error as exc:
            raise InfrastructureError(f"cannot connect to PostgreSQL: {exc}") from exc

    async def close(self) -> None:
        await self.pool.close()
