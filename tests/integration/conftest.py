"""Fixtures of the integration tests beyond the session's plaintext ``stack``.

``secured_stack``: `calmq dev up --secure` with every service — the broker with only a
SASL_SSL listener (SCRAM-SHA-512, a CA made at start), the registry behind HTTPS with basic
auth, the passwords as ``CALMQ_*_FILE`` — shared by every module that asks for it. It costs
~30 s to start and holds a broker, a registry, PostgreSQL and six services, so it is started
once, its users run one after the other (``pytest_collection_modifyitems``), and it stops
after the last of them rather than at the end of the session.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import psycopg
import pytest
import pytest_asyncio

from calmq.data import Database
from calmq.tooling.devstack import Stack, StackState

FIXTURE = "secured_stack"
# The services' settings (they also shape the topics the stack makes): short retry tiers and
# a quick batch lane, so a retry or a batch completes within a test's wait.
SECURED_SERVICES_ENV = {
    "CALMQ_RETRY_TIERS": "1s,5s", "CALMQ_RETRY_INITIAL_SECONDS": "0.2",
    "CALMQ_BATCH_MAX_AGE_SECONDS": "0.5", "CALMQ_BATCH_POLL_INTERVAL_SECONDS": "0.3",
    "CALMQ_BATCH_COMPLETION_WINDOW_SECONDS": "20", "CALMQ_BATCH_DEADLINE_MARGIN_SECONDS": "0",
}


class _SharedStack:
    """The secured stack, started on first use and stopped on demand."""

    def __init__(self) -> None:
        self.stack: Stack | None = None
        self.state: StackState | None = None
        self.failure: str | None = None

    def get(self) -> StackState:
        if self.state is not None:
            return self.state
        if self.failure is None:
            home = Path(tempfile.mkdtemp(prefix="calmq-secured-"))
            environ = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
            environ.update(SECURED_SERVICES_ENV)
            stack = Stack(home, environ, secure=True)
            try:
                self.state = stack.up(log=lambda _m: None)
                self.stack = stack
                return self.state
            except Exception as exc:  # noqa: BLE001 - any start failure is reported the same way
                self.failure = str(exc)
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the secured stack could not start in CI: {self.failure}",
                        pytrace=False)
        pytest.skip(f"the secured stack could not start here: {self.failure}")

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.down(log=lambda _m: None)
        self.stack = self.state = None


_SHARED = _SharedStack()


@pytest.fixture(scope="module")
def secured_stack() -> StackState:
    """The secured stack, shared with every other module that uses it."""
    return _SHARED.get()


def _uses(item: pytest.Item | None) -> bool:
    return item is not None and FIXTURE in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that use the secured stack, one after the other: after the last other test
    of the first module that uses it (so each module's tests stay together)."""
    users = [item for item in items if _uses(item)]
    if not users:
        return
    rest = [item for item in items if not _uses(item)]
    first = users[0].path
    same = [n for n, item in enumerate(rest) if item.path == first]
    at = same[-1] + 1 if same else sum(
        1 for item in items[:items.index(users[0])] if not _uses(item))
    items[:] = [*rest[:at], *users, *rest[at:]]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    """Once its last user's fixtures are torn down, the secured stack stops."""
    yield
    if _uses(item) and not _uses(nextitem):
        _SHARED.stop()


def pytest_sessionfinish() -> None:
    _SHARED.stop()


def _swap_db(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


@pytest.fixture
def fresh_db(stack: StackState) -> Iterator[str]:
    """A new, empty database on the stack's server, dropped after the test (for tests that
    migrate or preload a database of their own)."""
    admin = _swap_db(stack.env["CALMQ_DATABASE_URL"], "postgres")
    name = f"fresh_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}".encode())
    try:
        yield _swap_db(admin, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)".encode())


@pytest_asyncio.fixture
async def db(stack: StackState) -> AsyncIterator[Database]:
    """A data-layer handle on the stack's database, for tests that call calmq.data directly."""
    db = Database(stack.env["CALMQ_DATABASE_URL"], min_size=1, max_size=4)
    await db.open()
    yield db
    await db.close()
