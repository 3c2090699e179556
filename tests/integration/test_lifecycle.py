"""One lifecycle for the processors' processes, on the real stack: `calmq worker`, `batcher`,
`forwarder` and `reaper` each start, become ready, and when a critical side task stops they
drain like on SIGTERM and end with an error (a non-zero exit), never cleanly. The batcher
once skipped the shutdown wait and exited cleanly after such a failure."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from calmq import topics
from calmq.codec import make_codec
from calmq.errors import InfrastructureError
from calmq.kafka import consumer_config, create_topics, producer_config
from calmq.processors.batcher import BatchLane
from calmq.processors.forwarder import Forwarder, ForwarderService
from calmq.processors.reaper import Reaper
from calmq.processors.worker import Worker
from calmq.settings import Settings
from calmq.supervision import Lifecycle
from calmq.tooling.devstack import StackState

pytestmark = pytest.mark.integration


def _settings(stack: StackState, pool: str) -> Settings:
    return Settings.load({"pool": pool, "lease_seconds": 2.0, "grace_seconds": 1.0,
                          "retry_tiers": "1s", "consumer_lag_interval_seconds": 0.0},
                         environ=stack.env)


def _forwarder(s: Settings) -> ForwarderService:
    tiers = [topics.topic_for_route(topics.retry_route(t)) for t, _ in s.retry_tier_list]
    return ForwarderService(Forwarder(
        consumer_config(s.kafka_bootstrap, f"test-lifecycle-{uuid.uuid4().hex[:6]}"),
        Producer(producer_config(s.kafka_bootstrap)), make_codec(s.schema_registry_url),
        tiers), grace_seconds=1.0)


PROCESSES: dict[str, Callable[[Settings], object]] = {
    "worker": Worker, "batcher": BatchLane, "forwarder": _forwarder, "reaper": Reaper}


async def _ready(life: Lifecycle, run: asyncio.Task[None]) -> None:
    async with asyncio.timeout(60):
        while not life.ready.is_set():
            assert not run.done(), "the process ended before it was ready"
            await asyncio.sleep(0.05)  # poll


@pytest.mark.parametrize("name", sorted(PROCESSES))
async def test_a_critical_side_task_that_stops_ends_the_process_with_an_error(
        stack: StackState, name: str) -> None:
    """Once ready, a critical side task that stops makes the process drain and then raise
    side_task_stopped (the CLI exits non-zero with it), its consumer thread ended."""
    pool = f"life{uuid.uuid4().hex[:8]}"
    s = _settings(stack, pool)
    create_topics(s.kafka_bootstrap, topics.all_topics([pool], ["1s"]), partitions=1)
    process = PROCESSES[name](s)
    assert isinstance(process, Worker | BatchLane | ForwarderService | Reaper)
    run = asyncio.create_task(process.run())
    await _ready(process.life, run)

    async def heartbeat_gone() -> None:
        raise ConnectionError("the lease heartbeat cannot go on")

    process.life.side.spawn("test-critical", heartbeat_gone, critical=True)
    with pytest.raises(InfrastructureError) as raised:
        async with asyncio.timeout(60):
            await run
    assert raised.value.code == "side_task_stopped"
    assert "test-critical" in raised.value.message
    assert process.life.stop.is_set()
    assert process.life.side.names == []  # every side task, the consumer thread too, ended
