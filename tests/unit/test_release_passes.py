"""The housekeeping schedules the holds' release passes from the registry (calmq.holds) at
the paces it declares, as the hand-written passes ran before, and a hold whose rule is its
statement alone is an admission gate of its own (issue 45)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

from calmq.data import Store
from calmq.data.holds import HeldJobs
from calmq.holds import gate_statements
from calmq.processors.admission import StatementGate
from calmq.processors.releases import Housekeeping, schedule_releases, schedule_spend_release
from calmq.processors.request import Request
from calmq.spending import SpendCaps
from calmq.supervision import Supervisor
from calmq.workflows import Workflow


class _Side:
    def __init__(self) -> None:
        self.tasks: dict[str, tuple[float, float, bool]] = {}

    def every(self, name: str, interval: float, action: Callable[[], Awaitable[object]], *,
              first_after: float = 0.0, critical: bool = False) -> None:
        self.tasks[name] = (interval, first_after, critical)


class _Db:
    q: dict[str, str] = {}


class _Caps:
    refresh_seconds = 30.0


def _scheduled(workflows: dict[str, Workflow], *, caps: bool = True,
               quota: bool = True) -> dict[str, tuple[float, float, bool]]:
    side = _Side()
    hk = Housekeeping(cast(Store, _Db()), workflows, 5.0, lease_seconds=15.0,
                      sweeper_grace_seconds=120.0,
                      caps=cast(SpendCaps, _Caps()) if caps else None,
                      quota=cast(Any, object()) if quota else None)
    schedule_releases(cast(Supervisor, side), hk, first_after=5.0)
    return side.tasks


def test_a_worker_runs_every_pass_at_its_declared_pace() -> None:
    """Spend at its refresh, quota every second from the start, the stale room at a tenth of
    the grace, the others at the reaper's interval while no workflow makes them busy."""
    assert _scheduled({}) == {
        "spend-release": (30.0, 5.0, True), "quota-release": (1.0, 0.0, True),
        "fair-share-stale": (12.0, 5.0, True), "fair-share-picked": (5.0, 5.0, True),
        "concurrency-key-release": (5.0, 5.0, True),
        "timed-wait-release": (5.0, 5.0, True), "review-cap-release": (5.0, 5.0, True)}


def test_busy_passes_run_at_their_busy_pace_where_a_workflow_uses_them() -> None:
    """A concurrency limit makes the key release 0.2 s apart; fallback models or a key rate
    limit make the timed-wait release 0.5 s apart."""
    limited = cast(Workflow, type("W", (), {"concurrency_limit": 1, "key_rate_limit": {},
                                            "steps": [], "review_threshold": None})())
    tasks = _scheduled({"w": limited})
    assert tasks["concurrency-key-release"][0] == 0.2
    assert tasks["timed-wait-release"][0] == 0.5


def test_the_reaper_process_runs_no_quota_pass_and_the_batch_lane_the_spend_alone() -> None:
    """No quota here: no quota pass; the batch lane schedules the spend release alone."""
    assert "quota-release" not in _scheduled({}, quota=False)
    side = _Side()
    schedule_spend_release(cast(Supervisor, side), cast(SpendCaps, _Caps()), first_after=30.0)
    assert side.tasks == {"spend-release": (30.0, 30.0, True)}


class _Held:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[uuid.UUID]]] = []

    async def hold(self, statement: str, ids: list[uuid.UUID]) -> set[uuid.UUID]:
        self.calls.append((statement, list(ids)))
        return set(ids[:1])


class _Occupancy:
    def __init__(self, running: set[uuid.UUID]) -> None:
        self._running = running

    def running(self, job_id: uuid.UUID) -> bool:
        return job_id in self._running

    def held_by(self, tenant_id: uuid.UUID, priority: str | None = None) -> int:
        return 0


async def test_a_hold_whose_rule_is_sql_alone_is_a_gate_of_its_own() -> None:
    """A StatementGate runs its hold's statement on the jobs not running here and returns
    what the statement held; no registered hold is such a gate today."""
    assert gate_statements() == {}
    held = _Held()
    gate = StatementGate("paused", "hold_paused", cast(HeldJobs, held))
    a, b, running = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    requests = [cast(Request, type("R", (), {"job_id": j})()) for j in (a, running, b)]
    async with contextlib.AsyncExitStack() as stack:
        assert await gate.hold(requests, _Occupancy({running}), stack) == {a}
    assert held.calls == [("hold_paused", [a, b])]
    assert gate.name == "paused"
