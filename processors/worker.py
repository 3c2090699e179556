"""A worker process: the consumer thread, the step runner's event loop, leases, the reaper."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from calmq import topics
from calmq.budget import open_metered_provider
from calmq.codec import make_codec, registry_config
from calmq.data import Store
from calmq.data.spending import SpendLedger
from calmq.errors import InfrastructureError
from calmq.kafka import consumer_config, producer_config, service_connection
from calmq.objects import open_object_store
from calmq.processors import metrics
from calmq.processors.consumer import ParallelConsumer
from calmq.processors.lag import LagSampler, admin_config
from calmq.processors.poison import PoisonSink
from calmq.processors.reaper import (
    schedule_quota_release,
    schedule_reaper,
    schedule_spend_release,
)
from calmq.processors.runner import RunnerConfig, StepRunner
from calmq.retrying import Backoff
from calmq.reviews import ReviewDesk
from calmq.settings import Settings, claimed_window
from calmq.spending import SpendCaps, spend_caps_from_settings
from calmq.supervision import Supervisor
from calmq.workflows import Workflow, load_workflows

__all__ = ["Worker"]

log = logging.getLogger(__name__)


def _claimed_bound(slots: int) -> int:
    """Jobs to hold claimed: the call slots, plus an eighth to start the moment one frees
    (processors/slots.py), so a call never waits for a poll and a claim. The same window is
    KEDA's lagThreshold (calmq/tooling/keda.py), hence one function in the kernel."""
    return claimed_window(slots)


class Worker:
    def __init__(self, settings: Settings, workflows: dict[str, Workflow] | None = None) -> None:
        self.settings = settings
        self.workflows = workflows or load_workflows(settings)
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.stop = threading.Event()

    def topics(self) -> list[str]:
        return [topics.topic_for_route(topics.work_route(self.settings.pool, p))
                for p in self.settings.priority_list]

    async def run(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        # First: a Kafka configuration the brokers refuse stops the worker here, in one line.
        connection = await asyncio.to_thread(service_connection, s)
        # 4 group-commit writers, claims, leases
        store = Store(s.database_url, max_size=12, keep_errors=s.max_job_errors,
                      **Store.pool_options(s))
        await store.open()
        # The gateway under the fleet-wide token budget, metering tokens and cost per job.
        provider = await open_metered_provider(s, store)
        consumer = ParallelConsumer(
            consumer_config(connection, f"calmq.{s.pool}"),
            self.topics(),
            deliver=lambda batch: loop.call_soon_threadsafe(runner.submit, batch),
            max_in_flight=_claimed_bound(s.concurrency),
            commit_interval=s.commit_interval_ms / 1000,
            settling=lambda: runner.committer.pending,
        )
        codec = make_codec(s.schema_registry_url, registry_config(s))
        spend = spend_caps_from_settings(s, SpendLedger(store))
        runner = StepRunner(
            store=store,
            codec=codec,
            provider=provider,
            objects=open_object_store(s.object_store_url),
            workflows=self.workflows,
            tracker=consumer.tracker,
            poison=PoisonSink(Producer(producer_config(connection,
                                                      compression=s.kafka_compression)),
                              codec),
            usage=provider.usage.record if provider.usage is not None else None,
            spend=spend,
            allowance=provider.quota.allowance if provider.quota is not None else None,
            config=RunnerConfig(
                worker_id=self.worker_id,
                lease_seconds=s.lease_seconds,
                tiers=s.retry_tier_list,
                backoff=Backoff(s.retry_initial_seconds, s.retry_max_seconds, s.retry_multiplier),
                step_timeout_seconds=s.step_timeout_seconds,
                max_attempts=s.max_attempts,
                review_threshold=s.review_confidence_threshold,
                review_deadline_seconds=s.review_deadline_seconds,
                concurrency=s.concurrency,
                interactive_reserve=consumer.reserve,
            ),
        )
        runner.start()
        drained = threading.Event()
        thread = threading.Thread(
            target=consumer.run, args=(self.stop, drained.is_set), name="kafka-consumer",
            daemon=True,
        )
        thread.start()
        log.info("worker %s consuming %s", self.worker_id, ", ".join(self.topics()))
        side = self._side_tasks(store, runner, consumer, spend)
        if provider.quota is not None:  # else: the spend pass releases stale waits
            schedule_quota_release(side, SpendLedger(store), provider.quota)
        try:
            while not self.stop.is_set():
                tick = loop.time()
                await asyncio.sleep(0.1)
                metrics.LOOP_LAG.observe(max(0.0, loop.time() - tick - 0.1))
                metrics.IN_FLIGHT.set(runner.in_flight)
                metrics.SATURATION.set(runner.slots.used / s.concurrency)
                # Hold no more jobs than the token budget lets this worker start soon.
                limit = provider.in_flight_limit(s.budget_queue_seconds)
                consumer.max_in_flight = _claimed_bound(
                    s.concurrency if limit is None else max(1, min(s.concurrency, limit)))
            # Graceful stop: the consumer thread has paused every partition; in-flight work
            # gets the grace period to finish, and what is left is abandoned with its lease
            # handed back (its offset stays uncommitted, so the next owner redoes it).
            log.info("stopping: %d in flight, grace %.1f s", runner.in_flight, s.grace_seconds)
            deadline = loop.time() + s.grace_seconds
            while not runner.idle() and loop.time() < deadline:  # noqa: ASYNC110 - once, at exit
                await asyncio.sleep(0.05)
            abandoned = await runner.abandon()
            if abandoned:
                log.warning("abandoned %d attempts at the end of the grace period", abandoned)
            while runner.claiming:  # noqa: ASYNC110 - a batch still claiming hands over its jobs
                await asyncio.sleep(0.01)
            await runner.abandon()
            await runner.committer.drain()
        finally:
            drained.set()
            await asyncio.to_thread(thread.join, 30)
            await side.stop()
            await provider.close()
            await store.close()
        if side.failed.is_set():
            # Not a clean exit: the process is restarted, and its exit says why it stopped.
            raise InfrastructureError("the worker stopped because a side task it needs stopped")

    def _side_tasks(self, store: Store, runner: StepRunner,
                    consumer: ParallelConsumer, spend: SpendCaps) -> Supervisor:
        """Heartbeat leases every third of a lease, and stop the attempts whose leases could not
        be extended for most of one (self-fencing); requeue expired leases of dead workers;
        apply the expiry outcome to overdue reviews; sample consumer lag. A failed pass is
        retried next interval; a lease task that stops stops the worker (its leases would
        lapse, or nobody would reap)."""
        interval = max(0.2, self.settings.lease_seconds / 3)

        def stop_worker(name: str, _exc: BaseException | None) -> None:
            log.error("stopping the worker: its side task %s stopped", name)
            self.stop.set()

        side = Supervisor(on_critical=stop_worker)
        side.every("lease-heartbeat", interval, runner.heartbeat, first_after=interval,
                   critical=True)
        # Self-fencing: its own task, so that a heartbeat hanging on an unreachable database
        # cannot keep the attempts running past their leases.
        fence = max(0.1, self.settings.lease_seconds / 12)
        side.every("lease-fence", fence, runner.fence_expiring, first_after=fence,
                   critical=True)
        schedule_reaper(side, store, ReviewDesk(store, self.workflows, runner.objects),
                        interval, first_after=interval,
                        sweeper_grace_seconds=self.settings.sweeper_grace_seconds,
                        longest_tier_seconds=self.settings.retry_tier_list[-1][1])
        schedule_spend_release(side, spend, first_after=interval)
        lag_interval = self.settings.consumer_lag_interval_seconds
        if lag_interval > 0:
            lag = LagSampler(consumer.config, consumer.topics, lambda: consumer.owned)
            admin = [AdminClient(admin_config(consumer.config))]

            async def sample_lag() -> None:
                # In a thread: a sample is a few blocking broker round trips.
                try:
                    await asyncio.to_thread(lag.sample, admin[0])
                except Exception:
                    # After a broker restart the admin client kept the partitions' old leader
                    # epochs and answered every later sample FENCED_LEADER_EPOCH (the lag
                    # gauge, which autoscaling reads, froze for good in the chaos test): a
                    # new client after a failure starts from fresh metadata.
                    admin[0] = AdminClient(admin_config(consumer.config))
                    raise

            side.every("consumer-lag", lag_interval, sample_lag, first_after=lag_interval)
        return side
