"""The batch lane's batches keep their leases through the attempts' Leases (issue 45 item 3):
a batch is extended while a block keeps it, and no longer once every holder left."""

from __future__ import annotations

import uuid
from typing import Any, cast

from calmq.data import Store
from calmq.processors.leases import Leases


class _Batches:
    def __init__(self, answer: bool = True) -> None:
        self.beats: list[tuple[uuid.UUID, str, float]] = []
        self.answer = answer

    async def heartbeat(self, key: uuid.UUID, worker: str, lease_seconds: float) -> bool:
        self.beats.append((key, worker, lease_seconds))
        return self.answer


class _Store:
    def __init__(self, batches: _Batches) -> None:
        self.batches = batches


class _Side:
    def __init__(self) -> None:
        self.tasks: dict[str, tuple[float, float]] = {}

    def every(self, name: str, interval: float, action: Any, *, first_after: float = 0.0,
              critical: bool = False) -> None:
        self.tasks[name] = (interval, first_after)


async def test_a_batch_is_extended_while_a_block_keeps_it() -> None:
    """Each beat extends every batch kept, with the batch lease; none after the block."""
    batches = _Batches()
    leases = Leases(cast(Store, _Store(batches)), worker_id="b-1", lease_seconds=30.0)
    side = _Side()
    leases.schedule(cast(Any, side), batch_lease_seconds=90.0)
    assert side.tasks["batch-lease-heartbeat"] == (30.0, 30.0)
    key = uuid.uuid4()
    with leases.keeping_batch(key), leases.keeping_batch(key):
        await leases.keep_batches()
    await leases.keep_batches()
    assert batches.beats == [(key, "b-1", 90.0)]


async def test_a_failed_or_lost_extension_does_not_stop_the_beat() -> None:
    """A lease another poller took is logged and the next beat runs as usual."""
    batches = _Batches(answer=False)
    leases = Leases(cast(Store, _Store(batches)), worker_id="b-1", lease_seconds=30.0)
    leases.schedule(cast(Any, _Side()), batch_lease_seconds=90.0)
    with leases.keeping_batch(uuid.uuid4()):
        await leases.keep_batches()
        await leases.keep_batches()
    assert len(batches.beats) == 2


def test_a_worker_schedules_no_batch_heartbeat() -> None:
    """Without a batch lease (a worker) the schedule has the attempts' tasks alone."""
    side = _Side()
    Leases(cast(Store, _Store(_Batches())), worker_id="w", lease_seconds=30.0).schedule(
        cast(Any, side))
    assert set(side.tasks) == {"lease-heartbeat", "lease-fence"}
