"""Fixtures shared by every suite.

``stack`` starts the real local stack once per session (Kafka, PostgreSQL, the schema
registry, the fake provider and calmq's services) with the same code as `calmq dev up`.
In CI (``CI=true``) a part that cannot start fails the run; elsewhere the tests that need
it are skipped with the reason.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from calmq.tooling.devstack import Stack, StackState

_VERSIONS: dict[str, str] = {}


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def stack() -> Iterator[StackState]:
    """The whole local stack, started once for the session and stopped at its end."""
    data_dir = Path(tempfile.mkdtemp(prefix="calmq-test-"))
    stack = Stack(data_dir)
    try:
        state = stack.up(log=lambda _m: None)
    except Exception as exc:  # noqa: BLE001 - any start failure is reported the same way
        if _in_ci():
            pytest.fail(f"the local stack could not start in CI: {exc}", pytrace=False)
        pytest.skip(f"the local stack could not start here: {exc}")
    _VERSIONS.update(state.versions)
    _VERSIONS["ready_seconds"] = str(state.ready_seconds)
    try:
        yield state
    finally:
        if not os.environ.get("CALMQ_TEST_KEEP_STACK"):
            stack.down(log=lambda _m: None)


@pytest.fixture(scope="session")
def stack_env(stack: StackState) -> dict[str, str]:
    """The CALMQ_* variables that point a process at the session's stack."""
    return dict(stack.env)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _VERSIONS:
        terminalreporter.write_line(
            "real parts used: Kafka {kafka}, PostgreSQL {postgres}, schema registry "
            "{registry}; stack ready in {ready} s".format(
                kafka=_VERSIONS.get("kafka"),
                postgres=_VERSIONS.get("postgres"),
                registry=_VERSIONS.get("schema-registry", "none"),
                ready=_VERSIONS.get("ready_seconds"),
            )
        )
