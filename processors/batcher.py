"""The batch lane's processor (`calmq batcher`): the batcher packs batch-lane jobs into
provider batches, the poller collects each batch's results when it ends.

The batcher consumes ``calmq.<pool>.batch`` with the worker's own consumer and stages
(processors/pipeline.py: claims with leases, poison, deferral, heartbeats, the step's input
and recorded outputs): only its attempt's provider and its admission gates differ.
The packer (processors/batch_packer.py) turns each attempt's model call into a request of a
provider batch; the poller (processors/batch_poller.py) creates or adopts, collects and
settles the batches; their metrics are processors/batch_metrics.py's.

The process runs under the same lifecycle as a worker (calmq.supervision.Lifecycle): on
SIGTERM the packer flushes what it holds, the stages drain within the grace period, and a
critical side task that stops ends the process with an error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer

from calmq import topics
from calmq.calls import ProviderGate
from calmq.calls.batch_apis import BatchClient, open_batch_client
from calmq.calls.stack import open_gate
from calmq.codec import make_codec, registry_config
from calmq.data import Store
from calmq.data.concurrency import ConcurrencyKeys
from calmq.data.spending import SpendLedger
from calmq.kafka import consumer_config, producer_config, service_connection
from calmq.objects import ObjectStore, open_object_store
from calmq.processors.admission import (
    ConcurrencyKeyGate,
    Gate,
    ReviewCapGate,
    SpendCapGate,
    concurrency_limits,
    review_workflows,
    statement_gates,
)
from calmq.processors.attempt import Attempt
from calmq.processors.batch_metrics import BATCH_JOBS, OLDEST_BATCH, OPEN_BATCHES, RESERVED
from calmq.processors.batch_packer import BatchPacker
from calmq.processors.batch_poller import Poller, ReplyBook
from calmq.processors.consumer import ParallelConsumer
from calmq.processors.intake import Intake
from calmq.processors.pipeline import Pipeline, failure_stage
from calmq.processors.poison import PoisonSink
from calmq.processors.reaper import schedule_spend_release
from calmq.processors.slots import CallSlots
from calmq.settings import Settings
from calmq.spending import SpendCaps, spend_caps_from_settings
from calmq.supervision import Lifecycle
from calmq.workflows import Workflow, load_workflows

__all__ = ["BatchLane"]

log = logging.getLogger(__name__)


class BatchLane:
    """`calmq batcher`: the batcher and the poller of one pool in one process (a ``Service``
    of calmq.supervision, run until SIGTERM like a worker)."""

    name = "batcher"

    def __init__(self, settings: Settings, workflows: dict[str, Workflow] | None = None, *,
                 pack: bool = True, poll: bool = True) -> None:
        self.settings = settings
        self.workflows = workflows or load_workflows(settings)
        self.worker_id = settings.worker_id or f"batcher-{socket.gethostname()}-{os.getpid()}"
        self.pack = pack
        self.poll = poll
        self.life = Lifecycle(self, grace_seconds=settings.grace_seconds)
        self._store: Store | None = None
        self._packer: BatchPacker | None = None
        self._book: ReplyBook | None = None
        self._gate: ProviderGate | None = None
        self._pipeline: Pipeline | None = None
        self._consuming: asyncio.Task[None] | None = None
        self._packing: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._drained = threading.Event()

    def topic(self) -> str:
        return topics.topic_for_route(topics.batch_route(self.settings.pool))

    def _client(self) -> BatchClient:
        s = self.settings
        return open_batch_client(s.provider, s.effective_provider_url,
                                 s.provider_api_key.get_secret_value(), s.model,
                                 max_line=s.batch_max_result_line_bytes)

    async def _provider_gate(self, store: Store, client: BatchClient) -> ProviderGate:
        """The provider and model's fleet-wide gate, shared with the workers (the same key:
        kind and URL): a key refused in the batch lane blocks them online too, and the other
        way round; a probe call every provider_probe_seconds lifts it and releases the
        jobs that wait for it."""
        s = self.settings
        return await open_gate(store, s.provider, s.effective_provider_url,
                               s.provider_api_key.get_secret_value(), s.model,
                               probe=client.probe, probe_seconds=s.provider_probe_seconds)

    async def run(self) -> None:
        await self.life.run()

    async def start(self, life: Lifecycle) -> None:
        s = self.settings
        connection = await asyncio.to_thread(service_connection, s)
        store = self._store = Store(s.database_url, max_size=8, keep_errors=s.max_job_errors,
                                    **Store.pool_options(s))
        await store.open()
        objects = open_object_store(s.object_store_url)
        packer = self._packer = BatchPacker(self._client(), s, store, self.worker_id)
        # Spend caps hold on this lane as online: a capped tenant's jobs wait in queued
        # before they are packed (half price is still spend), and the fleet-wide release
        # pass re-publishes them to this lane once no cap holds them.
        ledger = SpendLedger(store)
        spend = spend_caps_from_settings(s, ledger)
        packer.spend = spend
        consumer, pipeline = self._stages(connection, store, objects, packer,
                                          self._gates(store, spend, ledger))
        self._pipeline = pipeline
        packer.pipeline = pipeline
        book_client = self._client()
        gate = self._gate = await self._provider_gate(store, book_client)
        packer.gate = gate
        book = self._book = ReplyBook(book_client, s, gate)
        poller = Poller(store=store, client=book.client,
                        settler=self._settler(store, objects, book), book=book,
                        settings=s, worker_id=self.worker_id, leases=pipeline.leases,
                        gate=gate)
        pipeline.start()
        self._schedule(life, store=store, consumer=consumer, packer=packer,
                       pipeline=pipeline, poller=poller, spend=spend)
        log.info("batcher %s: %s, provider %s, model %s", self.worker_id, self.topic(),
                 s.provider, s.model)

    def _gates(self, store: Store, spend: SpendCaps, ledger: SpendLedger) -> list[Gate]:
        """The lane's admission gates: a job they hold waits before it is packed."""
        s = self.settings
        # The holds whose rule is SQL alone (calmq.holds) hold here as online.
        gates: list[Gate] = [SpendCapGate(spend, ledger), *statement_gates(store),
                             ReviewCapGate(store, review_workflows(self.workflows))]
        # A workflow's concurrency_limit holds on this lane as online: a key's jobs beyond
        # it wait (concurrency_key) before they are packed, and a packed job counts as
        # running until its result settles, so a pack takes no more of a key's jobs than
        # the limit leaves room for. The fleet's release pass (every worker and `calmq
        # reaper` that load the workflow) re-publishes them to this lane as those settle.
        limits = concurrency_limits(self.workflows)
        if limits:
            gates.append(ConcurrencyKeyGate(ConcurrencyKeys(store), limits, s.lease_seconds,
                                            waiting_max=s.concurrency_keys_waiting_max))
        return gates

    def _stages(self, connection: dict[str, Any], store: Store, objects: ObjectStore,
                packer: BatchPacker, gates: list[Gate]) -> tuple[ParallelConsumer, Pipeline]:
        """The worker's consumer and stages, with the packer as the attempt's provider."""
        s = self.settings
        loop = asyncio.get_running_loop()
        codec = make_codec(s.schema_registry_url, registry_config(s),
                           s.name_prefix)
        window = packer.max_requests
        consumer = ParallelConsumer(
            consumer_config(connection, topics.batcher_group(s.pool)), [self.topic()],
            deliver=lambda batch: loop.call_soon_threadsafe(pipeline.submit, batch),
            max_in_flight=window, commit_interval=s.commit_interval_ms / 1000,
            interactive_reserve=0, settling=lambda: pipeline.committer.pending)
        poison = PoisonSink(Producer(producer_config(connection,
                                                     compression=s.kafka_compression)), codec)
        failures = failure_stage(s, self.worker_id, self.workflows)
        # A packed attempt waits for its batch to be recorded: its step timeout is the
        # provider's window, and a pack's worth of them wait at once.
        pipeline = Pipeline(
            store=store, tracker=consumer.tracker,
            intake=Intake(codec, poison, consumer.tracker),
            gates=gates,
            attempt=Attempt(store=store, provider=packer, objects=objects,
                            workflows=self.workflows, failures=failures,
                            worker_id=self.worker_id, slots=CallSlots(window),
                            step_timeout_seconds=s.batch_completion_window_seconds,
                            review_deadline_seconds=s.review_deadline_seconds,
                            key_rate_limits=False),
            worker_id=self.worker_id, lease_seconds=s.lease_seconds, workflows=self.workflows)
        return consumer, pipeline

    def _settler(self, store: Store, objects: ObjectStore, book: ReplyBook
                 ) -> Callable[[str], Attempt]:
        """The poller's attempt stage for a batch's lease owner, answered by ``book``."""
        s = self.settings

        def settler(owner: str) -> Attempt:
            return Attempt(store=store, provider=book, objects=objects,
                           workflows=self.workflows,
                           failures=failure_stage(s, owner, self.workflows), worker_id=owner,
                           step_timeout_seconds=s.step_timeout_seconds or 60.0,
                           review_deadline_seconds=s.review_deadline_seconds,
                           key_rate_limits=False)

        return settler

    def _schedule(self, life: Lifecycle, *, store: Store, consumer: ParallelConsumer,
                  packer: BatchPacker, pipeline: Pipeline, poller: Poller,
                  spend: SpendCaps) -> None:
        """The lane's side tasks: consuming and packing, the leases, the spend release, the
        poller and the gauges."""
        s = self.settings
        if self.pack:
            self._consuming = life.side.spawn(
                "kafka-consumer", lambda: asyncio.to_thread(consumer.run, life.stop,
                                                            self._drained.is_set),
                critical=True)
            self._packing = life.side.spawn("batch-packer", lambda: packer.run(self._stopping),
                                            critical=True)
        pipeline.leases.schedule(life.side, batch_lease_seconds=s.batch_lease_seconds)
        if self.pack:
            schedule_spend_release(life.side, spend, first_after=spend.refresh_seconds)
        if self.poll:
            life.side.every("batch-poller", min(1.0, s.batch_poll_interval_seconds),
                            poller.pass_once)

        async def gauges() -> None:
            stats = await store.batches.stats()
            OPEN_BATCHES.set(stats.get("open_batches", 0))
            OLDEST_BATCH.set(stats.get("oldest_seconds", 0.0))
            for state in ("pending", "settled", "retried", "cancelled"):
                BATCH_JOBS.labels(state).set((stats.get("jobs_by_state") or {}).get(state, 0))
            RESERVED.set(stats.get("reserved_usd", 0.0))

        life.side.every("batch-gauges", 5.0, gauges)

    async def tick(self) -> None:
        return None

    async def drain(self, grace_seconds: float) -> None:
        # What the packer holds goes into batches now; then the stages drain exactly as a
        # worker's do (processors/pipeline.py).
        self._stopping.set()
        if self._packer is not None:
            await self._packer.flush_all()
        if self._packing is not None:
            await asyncio.wait([self._packing], timeout=30)
        if self._pipeline is not None:
            await self._pipeline.drain(grace_seconds)
        await self._stop_consuming()

    async def _stop_consuming(self) -> None:
        self._drained.set()
        if self._consuming is not None:
            await asyncio.wait([self._consuming], timeout=30)

    async def close(self) -> None:
        self._stopping.set()
        await self._stop_consuming()
        if self._packer is not None:
            await self._packer.close()
        if self._gate is not None:
            await self._gate.close()
        if self._book is not None:
            await self._book.client.close()
        if self._store is not None:
            await self._store.close()
