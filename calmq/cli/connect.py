"""Connections a command opens: fail within seconds, naming the address, never a traceback.

A service waits and retries for its parts (calmq.retrying); a person at a terminal wants the
answer now. So a command first tries one plain connection with a short timeout and turns a
refusal into ``calmq: error [database_unreachable]: ...`` with the host and port, instead of
the pool's fifteen seconds of warnings.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from calmq.errors import InfrastructureError

if TYPE_CHECKING:
    from calmq.data import Store
    from calmq.settings import Settings

__all__ = ["CONNECT_TIMEOUT_SECONDS", "database_address", "open_store", "unreachable"]

CONNECT_TIMEOUT_SECONDS = 3


def database_address(url: str) -> str:
    """``host:port/dbname`` of a connection URL, without the password."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        info = conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - an unparsable URL is shown as "?" rather than leaked
        return "?"
    return f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}/{info.get('dbname', '')}"


def unreachable(url: str, exc: BaseException) -> InfrastructureError:
    """``database_unreachable`` naming the address (never the password) and the reason."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return InfrastructureError(
        f"PostgreSQL at {database_address(url)} is not reachable ({reason}): check "
        "CALMQ_DATABASE_URL, or start the local stack with `calmq dev up`",
        code="database_unreachable",
    )


@contextlib.asynccontextmanager
async def open_store(settings: Settings, *, max_size: int = 2) -> AsyncIterator[Store]:
    """An open Store on the settings' database, closed on leaving; fails fast if unreachable."""
    import psycopg

    from calmq.data import Store

    try:
        probe = await psycopg.AsyncConnection.connect(
            settings.database_url, connect_timeout=CONNECT_TIMEOUT_SECONDS)
    except psycopg.Error as exc:
        raise unreachable(settings.database_url, exc) from exc
    await probe.close()
    store = Store(settings.database_url, min_size=1, max_size=max_size,
                  keep_errors=settings.max_job_errors, **Store.pool_options(settings))
    await store.open()
    try:
        yield store
    finally:
        await store.close()
