"""The fair share gate (processors/admission.py, ``FairShareGate``): which polled jobs go to
the claim and which join their queue's waiting room. The room itself (the hold and the
weighted pick) is PostgreSQL's: tests/integration/test_fair_share.py."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from calmq.processors.admission import FairShareGate
from calmq.processors.request import Request
from calmq.processors.slots import queue_room


class Room:
    """The waiting room's hold, as FairQueue.hold answers it: every waiting job is held."""

    def __init__(self) -> None:
        self.held: list[uuid.UUID] = []

    async def hold(self, ids: list[uuid.UUID]) -> set[uuid.UUID]:
        self.held += ids
        return set(ids)


class Running:
    def __init__(self, *running: uuid.UUID) -> None:
        self.ids = set(running)

    def running(self, job_id: uuid.UUID) -> bool:
        return job_id in self.ids

    def held_by(self, tenant_id: uuid.UUID, priority: str | None = None) -> int:
        return 0


def _requests(n: int, priority: str = "bulk", tenant: str | None = None) -> list[Request]:
    owner = str(uuid.uuid4()) if tenant is None else tenant
    return [Request(((f"calmq.p.{priority}", 0), i), uuid.uuid4(), "s", "w", owner, priority,
                    None) for i in range(n)]


def _gate(free: dict[str, int]) -> tuple[FairShareGate, Room]:
    """Free slots per queue that every job on its way to a slot takes from both queues."""
    room = Room()
    return FairShareGate(room, "p",  # type: ignore[arg-type]
                         lambda priority, passing: free[priority] - sum(passing.values())
                         ), room


def _hold(gate: FairShareGate, batch: list[Request], occupancy: Running | None = None
          ) -> set[uuid.UUID]:
    async def run() -> set[uuid.UUID]:
        async with contextlib.AsyncExitStack() as stack:
            return await gate.hold(batch, occupancy or Running(), stack)

    return asyncio.run(run())


def test_an_uncontended_lane_claims_what_fits_and_holds_the_rest() -> None:
    """With 3 free slots, 3 of 5 jobs go to the claim; the other 2 wait in the room, and
    the queue is contended from then on."""
    gate, room = _gate({"bulk": 3, "interactive": 4})
    batch = _requests(5)
    assert _hold(gate, batch) == {r.job_id for r in batch[3:]}
    assert room.held == [r.job_id for r in batch[3:]]
    assert gate.contended == {"bulk"}


def test_a_contended_lane_holds_every_new_job_even_with_free_slots() -> None:
    """While the room holds jobs, a new one joins it (the fill gives free slots to the
    fairest tenant), so arrivals do not jump the queue; the other queue is not touched."""
    gate, _room = _gate({"bulk": 10, "interactive": 10})
    gate.contended.add("bulk")
    bulk, interactive = _requests(2), _requests(2, "interactive")
    assert _hold(gate, bulk + interactive) == {r.job_id for r in bulk}
    gate.contended.discard("bulk")  # the fill found the room empty
    assert _hold(gate, _requests(2)) == set()


def test_jobs_let_through_count_against_the_slots_until_their_claim_ended() -> None:
    """Two claims at once must not both take the last free slots: what one batch let
    through counts until its claim's stack closed."""
    gate, _room = _gate({"bulk": 4, "interactive": 4})

    async def run() -> tuple[set[uuid.UUID], set[uuid.UUID], int]:
        first, second = _requests(3), _requests(3)
        async with contextlib.AsyncExitStack() as stack:
            held_first = await gate.hold(first, Running(), stack)
            assert gate.free("bulk") == 1
            async with contextlib.AsyncExitStack() as other:
                held_second = await gate.hold(second, Running(), other)
        return ({r.job_id for r in first} & held_first,
                {r.job_id for r in second} & held_second, gate.free("bulk"))

    held_first, held_second, free_after = asyncio.run(run())
    assert held_first == set()
    assert len(held_second) == 2  # one slot was left for it
    assert free_after == 4


def test_a_redelivered_running_job_and_a_tenantless_one_go_to_the_claim() -> None:
    """A message of a job this worker runs already is the claim's to acknowledge, and a
    job without a tenant has no share to wait for: neither joins the room."""
    gate, room = _gate({"bulk": 0, "interactive": 0})
    mine, tenantless = _requests(1), _requests(1, tenant="")
    assert _hold(gate, mine + tenantless, Running(mine[0].job_id)) == set()
    assert room.held == []


def test_the_two_lanes_share_the_free_slots() -> None:
    """Bulk and interactive jobs take the same call slots (interactive also its reserve):
    with 2 free bulk slots and 3 interactive ones, a batch of 2 interactive and 2 bulk jobs
    lets the 2 interactive through and holds both bulk ones."""
    gate, _room = _gate({"bulk": 2, "interactive": 3})
    interactive, bulk = _requests(2, "interactive"), _requests(2)
    assert _hold(gate, interactive + bulk) == {r.job_id for r in bulk}


def test_bulk_on_its_way_to_a_slot_leaves_the_interactive_reserve_alone() -> None:
    """A worker's room (processors/worker.py): bound 32, reserve 8, 30 bulk jobs held. A
    bulk pick in progress takes the 2 general slots left; an interactive job arriving
    meanwhile still finds the reserve and goes to the claim, not the waiting room."""
    held, interactive_held = 30, 0
    gate = FairShareGate(Room(), "p",  # type: ignore[arg-type]
                         lambda priority, passing: queue_room(
                             priority, 32, 8, held=held + sum(passing.values()),
                             interactive=interactive_held + passing.get("interactive", 0)))
    gate.taking("bulk", gate.free("bulk"))  # the fill picks for every free bulk slot
    assert gate.free("bulk") == 0
    assert gate.free("interactive") == 8
    batch = _requests(9, "interactive")
    assert _hold(gate, batch) == {batch[-1].job_id}  # the reserve's 8 pass, the 9th waits
    gate.done("bulk", 2)
    assert gate.free("bulk") == 2
