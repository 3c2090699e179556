"""`calmq worker`: the consumer thread, the stages (processors/pipeline.py), the leases'
heartbeat and fencing, the fleet's housekeeping and the lag gauge, under one lifecycle
(calmq.supervision.Lifecycle: drain on SIGTERM, a critical side task that stops ends the
process with an error)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Mapping

from confluent_kafka import Producer

from calmq import topics
from calmq.calls import BudgetedProvider, OutputWriter
from calmq.calls.stack import open_metered_provider, open_step_models
from calmq.codec import make_codec, registry_config
from calmq.data import Store
from calmq.data.concurrency import ConcurrencyKeys
from calmq.data.fairness import FairQueue
from calmq.data.spending import SpendLedger
from calmq.jobs import Priority
from calmq.kafka import consumer_config, producer_config, service_connection
from calmq.lag import LagReader
from calmq.objects import open_object_store
from calmq.processors import metrics
from calmq.processors.admission import (
    ConcurrencyKeyGate,
    FairShareGate,
    Gate,
    QuotaGate,
    ReviewCapGate,
    SpendCapGate,
    concurrency_limits,
    review_workflows,
    statement_gates,
)
from calmq.processors.attempt import Attempt
from calmq.processors.consumer import ParallelConsumer
from calmq.processors.intake import Intake
from calmq.processors.pipeline import Pipeline, failure_stage
from calmq.processors.poison import PoisonSink
from calmq.processors.reaper import housekeeping, schedule_history_partitions, schedule_reaper
from calmq.processors.slots import CallSlots, queue_room
from calmq.reviews import ReviewDesk
from calmq.settings import Settings, claimed_window
from calmq.spending import spend_caps_from_settings
from calmq.supervision import Lifecycle, Supervisor
from calmq.workflows import Workflow, load_workflows
from calmq.workflows.progress import ChildLimits

__all__ = ["Worker", "schedule_lag_gauge"]

log = logging.getLogger(__name__)


def _claimed_bound(slots: int) -> int:
    """Jobs to hold claimed: the call slots, plus an eighth to start the moment one frees
    (processors/slots.py), so a call never waits for a poll and a claim. The same window is
    KEDA's lagThreshold (calmq/tooling/keda.py), hence one function in the kernel."""
    return claimed_window(slots)


def schedule_lag_gauge(side: Supervisor, consumer: ParallelConsumer, interval: float) -> None:
    """``calmq_consumer_lag_messages`` per topic over the partitions this process owns, read
    by the kernel's lag reader (calmq.lag) in a thread every ``interval`` seconds."""
    reader = LagReader(consumer.config)
    group = str(consumer.config["group.id"])

    async def sample() -> None:
        rows = await asyncio.to_thread(reader.read, group, sorted(consumer.owned))
        lag = dict.fromkeys(consumer.topics, 0)
        for row in rows:
            lag[row.topic] = lag.get(row.topic, 0) + row.lag
        for topic, value in lag.items():
            metrics.CONSUMER_LAG.labels(topic).set(value)

    side.every("consumer-lag", interval, sample, first_after=interval)


class Worker:
    """A worker process (a ``Service`` of calmq.supervision): ``run()`` until SIGTERM."""

    name = "worker"

    def __init__(self, settings: Settings, workflows: dict[str, Workflow] | None = None) -> None:
        self.settings = settings
        self.workflows = workflows or load_workflows(settings)
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.life = Lifecycle(self, grace_seconds=settings.grace_seconds)
        self._store: Store | None = None
        self._provider: BudgetedProvider | None = None
        self._models: list[BudgetedProvider] = []  # steps' fallback models besides it
        self._pipeline: Pipeline | None = None
        self._outputs: OutputWriter | None = None
        self._consumer: ParallelConsumer | None = None
        self._consuming: asyncio.Task[None] | None = None
        self._drained = threading.Event()
        self._last_tick = 0.0
        # Call slots the budget lets this worker use now (set on every tick).
        self._call_slots = settings.concurrency

    def topics(self) -> list[str]:
        return [topics.topic_for_route(topics.work_route(self.settings.pool, p))
                for p in self.settings.priority_list]

    async def run(self) -> None:
        await self.life.run()

    @property
    def pipeline(self) -> Pipeline:
        assert self._pipeline is not None, "the worker has not started"
        return self._pipeline

    async def start(self, life: Lifecycle) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        # First: a Kafka configuration the brokers refuse stops the worker here, in one line.
        connection = await asyncio.to_thread(service_connection, s)
        # 4 group-commit writers, claims, leases
        store = self._store = Store(s.database_url, max_size=12, keep_errors=s.max_job_errors,
                                    **Store.pool_options(s))
        await store.open()
        # The gateway under the fleet-wide token budget, metering tokens and cost per job.
        provider = self._provider = await open_metered_provider(s, store)
        # The steps that name their allowed models fall back across them (calmq.calls.fallback).
        step_providers, self._models = await open_step_models(s, store, self.workflows,
                                                              provider)
        consumer = self._consumer = ParallelConsumer(
            consumer_config(connection, topics.worker_group(s.pool)),
            self.topics(),
            deliver=lambda batch: loop.call_soon_threadsafe(self.pipeline.submit, batch),
            max_in_flight=_claimed_bound(s.concurrency),
            commit_interval=s.commit_interval_ms / 1000,
            settling=lambda: self.pipeline.committer.pending,
            # Bulk calls hold their slots for as long as the model takes: interactive work
            # beyond this reserve waits for them to end (seconds each).
            interactive_reserve=s.interactive_reserve,
            read_ahead=Pipeline.CLAIM_BATCH if s.fair_share else 0,
        )
        codec = make_codec(s.schema_registry_url, registry_config(s),
                           s.name_prefix)
        objects = open_object_store(s.object_store_url)
        ledger = SpendLedger(store)
        spend = spend_caps_from_settings(s, ledger)
        gates: list[Gate] = [SpendCapGate(spend, ledger)]
        if provider.quota is not None:
            gates.append(QuotaGate(provider.quota.allowance, ledger))
        gates += statement_gates(store)  # the holds whose rule is SQL alone (calmq.holds)
        # Fair share before the gates that count what they admitted (a review's place under
        # its pool's cap, a concurrency key's slot): a job they let through and the waiting
        # room then held counted nowhere, and the jobs behind it passed the cap as well. A
        # job picked from the room passes them on its way to the claim.
        fair: FairShareGate | None = None
        if s.fair_share:
            fair = FairShareGate(FairQueue(store), s.pool, self._room, s.priority_list,
                                 headroom=self._headroom)
            gates.append(fair)
        gates.append(ReviewCapGate(store, review_workflows(self.workflows)))
        limits = concurrency_limits(self.workflows)
        if limits:
            gates.append(ConcurrencyKeyGate(ConcurrencyKeys(store), limits, s.lease_seconds,
                                            waiting_max=s.concurrency_keys_waiting_max))
        poison = PoisonSink(Producer(producer_config(connection,
                                                     compression=s.kafka_compression)), codec)
        self._outputs = OutputWriter(store.outputs, flush_seconds=s.output_flush_seconds)
        self._pipeline = Pipeline(
            store=store, tracker=consumer.tracker, intake=Intake(codec, poison, consumer.tracker),
            gates=gates,
            attempt=Attempt(store=store, provider=provider, objects=objects,
                            workflows=self.workflows,
                            failures=failure_stage(s, self.worker_id, self.workflows),
                            worker_id=self.worker_id,
                            slots=CallSlots(s.concurrency, consumer.reserve),
                            step_timeout_seconds=s.step_timeout_seconds,
                            review_deadline_seconds=s.review_deadline_seconds,
                            outputs=self._outputs, step_providers=step_providers,
                            child_limits=ChildLimits(s.children_per_parent_max,
                                                     s.children_depth_max,
                                                     s.children_in_flight_max)),
            worker_id=self.worker_id, lease_seconds=s.lease_seconds, workflows=self.workflows,
            usage=provider.usage.record if provider.usage is not None else None, fair=fair)
        self.pipeline.start()
        # The consumer thread is a critical side task: a worker that stopped polling would
        # hold its partitions and do nothing.
        self._consuming = life.side.spawn(
            "kafka-consumer", lambda: asyncio.to_thread(consumer.run, life.stop,
                                                        self._drained.is_set),
            critical=True)
        log.info("worker %s consuming %s", self.worker_id, ", ".join(self.topics()))
        interval = max(0.2, s.lease_seconds / 3)
        self.pipeline.leases.schedule(life.side)
        # The fleet's housekeeping: requeue expired leases of dead workers, the sweeper, the
        # review timer and the holds' release passes. A failed pass is retried next interval.
        # Without a token quota the spend pass releases the quota's stale waits.
        hk = housekeeping(s, store, self.workflows, interval, caps=spend,
                          quota=provider.quota)
        schedule_reaper(life.side, hk, ReviewDesk(store, self.workflows, objects),
                        first_after=interval, longest_tier_seconds=s.retry_tier_list[-1][1])
        schedule_history_partitions(life.side, store, s)
        if s.consumer_lag_interval_seconds > 0:
            schedule_lag_gauge(life.side, consumer, s.consumer_lag_interval_seconds)

    async def tick(self) -> None:
        s = self.settings
        pipeline, consumer, provider = self.pipeline, self._consumer, self._provider
        assert consumer is not None
        assert provider is not None
        loop = asyncio.get_running_loop()
        if self._last_tick:  # how late the lifecycle's timer woke this tick
            metrics.LOOP_LAG.observe(
                max(0.0, loop.time() - self._last_tick - self.life.tick_seconds))
        metrics.IN_FLIGHT.set(pipeline.in_flight)
        slots = pipeline.attempt.slots
        metrics.SATURATION.set((slots.used if slots else 0) / s.concurrency)
        # Hold no more jobs than the token budget lets this worker start soon.
        limit = provider.in_flight_limit(s.budget_queue_seconds)
        self._call_slots = s.concurrency if limit is None else max(1, min(s.concurrency, limit))
        consumer.max_in_flight = _claimed_bound(self._call_slots)
        # Free slots and another worker's holds: take from the queues' waiting rooms.
        pipeline.fill_soon()
        self._last_tick = loop.time()

    def _room(self, priority: str, passing: Mapping[str, int]) -> int:
        """With fair share: the jobs of a queue this worker may start now. A job claimed
        beyond the free call slots waits for one in claim order (processors/slots.py), so a
        small tenant's job picked behind the claimed window's eighth (32 jobs at 256 slots)
        waited for all of them: ~250 ms with 2 s calls. Here a job is taken for a call
        slot free now, plus a sixty-fourth so that a slot that frees need not wait for the
        next pick; for interactive work the reserve beyond them.

        Bulk work past that bound (claimed while the token budget let this worker hold more
        than it does now: ``_call_slots`` follows the budget each tick) does not take the
        interactive reserve: counted against it, an interactive job with no other tenant in
        its queue waited in the room for a bulk call to end (bench priority: 131 ms to the
        first attempt against 8.5 ms, for the slowest twentieth). Nor do the bulk jobs on
        their way to a slot (``passing``, per queue: a pick in progress counts all the free
        slots it may fill)."""
        consumer = self._consumer
        assert consumer is not None
        leases = self.pipeline.leases
        interactive = passing.get(Priority.INTERACTIVE, 0)
        return queue_room(priority, self._call_slots + self._ahead(), consumer.reserve,
                         held=len(leases) + sum(passing.values()),
                         interactive=leases.interactive + interactive)

    def _ahead(self) -> int:
        return max(1, self._call_slots // 64)

    def _headroom(self) -> int:
        """With fair share: of ``_room``, what a tenant above its weighted share leaves to
        the others while they run or wait: the claimed-ahead jobs (a job picked behind them
        waits in the slots' queue for a call to end) and then call slots that stay free
        (setting fair_share_headroom), so another tenant's job starts its call at once."""
        s = self.settings
        free = self._call_slots // 256 if s.fair_share_headroom is None \
            else s.fair_share_headroom
        return self._ahead() + free

    async def drain(self, grace_seconds: float) -> None:
        # The consumer thread has paused every partition (the stop event): in-flight work
        # gets the grace period, then the consumer commits what is done and leaves.
        if self._pipeline is not None:
            await self._pipeline.drain(grace_seconds)
        await self._stop_consuming()

    async def _stop_consuming(self) -> None:
        self._drained.set()
        if self._consuming is not None:
            await asyncio.wait([self._consuming], timeout=30)

    async def close(self) -> None:
        await self._stop_consuming()
        if self._outputs is not None:
            await self._outputs.close()
        for model in self._models:
            await model.close()
        if self._provider is not None:
            await self._provider.close()
        if self._store is not None:
            await self._store.close()
