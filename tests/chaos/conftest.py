"""The chaos suite's shared production-shaped stack: three Kafka brokers and a PostgreSQL
primary with a streaming standby (tests/support/chaos.py), started once for the broker-loss
and the failover tests (its start is most of their cost)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.chaos import ChaosStack, Results


@pytest.fixture(scope="session")
def cluster() -> Iterator[tuple[ChaosStack, Results]]:
    """Three brokers (replication 3, min.insync.replicas 2) and a primary with a standby
    behind one database address, with calmq's services; stopped at the session's end."""
    home = Path(tempfile.mkdtemp(prefix="calmq-cluster-"))
    try:
        stack = ChaosStack(home, brokers=3, standby=True)
    except Exception as exc:  # noqa: BLE001 - reported the way the session stack reports it
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the three-broker, two-database stack could not start in CI: {exc}",
                        pytrace=False)
        pytest.skip(f"the three-broker, two-database stack could not start here: {exc}")
    results = Results(stack.bootstrap, stack.registry_url)
    try:
        yield stack, results
    finally:
        results.close()
        stack.close()
        if not os.environ.get("CALMQ_TEST_KEEP_STACK"):
            shutil.rmtree(home / "stack", ignore_errors=True)
