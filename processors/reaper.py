"""The reaper, the sweeper and the review timer: the fleet's housekeeping, as supervised
side tasks.

Every worker runs them beside its lease heartbeat, and ``calmq reaper`` runs them on their
own (for a fleet scaled to zero workers). Each pass is one statement or a few: a job whose
lease expired (its worker died) is requeued with ``requeued_after_restart`` and a fresh
``job.requested``; a waiting job that no message carries any more (queued, or retrying past
its due time, for longer than the sweeper's grace) gets a fresh ``job.requested`` and
``requeued_by_sweeper``; a job whose lease expired on an attempt that used up its budget
is dead-lettered with the code ``poison`` (the attempt cap); a review past its deadline
gets its workflow's expiry outcome; the streamed chunks of a final job are compacted into
one text per step. The holds' release passes run beside them, as the holds registry declares
them (processors/releases.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

from calmq.calls import TenantQuota
from calmq.data import Store
from calmq.data.partitions import HistoryPartitions
from calmq.data.rate_keys import RateKeys
from calmq.data.spending import SpendLedger
from calmq.errors import FailureClass
from calmq.objects import open_object_store
from calmq.processors import metrics
from calmq.processors.releases import Housekeeping, schedule_releases, schedule_spend_release
from calmq.reviews import ReviewDesk
from calmq.settings import Settings
from calmq.spending import SpendCaps, spend_caps_from_settings
from calmq.supervision import Lifecycle, Supervisor
from calmq.workflows import Workflow, load_workflows

# schedule_spend_release: the batch lane's (processors/releases.py).
__all__ = ["POISON_ERROR", "Reaper", "housekeeping", "schedule_history_partitions",
           "schedule_reaper", "schedule_spend_release"]

log = logging.getLogger(__name__)

# The contract has no poison failure class: a job whose input kills its worker is treated
# as poison input (class input, not retried), as processors/poison.py treats an unreadable
# message, with its own code.
POISON_ERROR: dict[str, str] = {
    "code": "poison", "class": FailureClass.INPUT.value,
    "message": "every attempt ended with its worker (killed, out of memory?) before an"
               " outcome was written, up to the attempt budget; not run again"}


def housekeeping(s: Settings, store: Store, workflows: Mapping[str, Workflow],
                 interval: float, *, caps: SpendCaps | None = None,
                 quota: TenantQuota | None = None) -> Housekeeping:
    """The release passes' view of a process, from its settings."""
    return Housekeeping(store, workflows, interval, lease_seconds=s.lease_seconds,
                        sweeper_grace_seconds=s.sweeper_grace_seconds,
                        concurrency_release_batch=s.concurrency_release_batch,
                        concurrency_keys_waiting_max=s.concurrency_keys_waiting_max,
                        caps=caps, quota=quota)


def schedule_reaper(side: Supervisor, hk: Housekeeping, desk: ReviewDesk, *,
                    longest_tier_seconds: float, first_after: float = 0.0) -> None:
    """Run the reaper, the sweeper, the review timer and the holds' release passes
    (processors.releases, from the holds registry) under ``side`` (the reaper and the timer
    every ``hk.interval`` seconds, the sweeper every tenth of its grace at most that often),
    as critical tasks: a process whose reaper stopped must not look healthy."""
    store, interval = hk.store, hk.interval

    async def reap() -> None:
        # The attempt cap first: a job that killed its worker on its last allowed attempt
        # is dead-lettered, not requeued to kill the next one (reap leaves such jobs alone).
        poisoned = await store.jobs.dead_letter_poisoned(POISON_ERROR)
        if poisoned:
            metrics.DEAD_LETTERS.labels(POISON_ERROR["class"]).inc(len(poisoned))
            log.warning("dead-lettered %d jobs whose every attempt ended with its worker",
                        len(poisoned))
        reaped = await store.jobs.reap_expired_leases()
        if reaped:
            metrics.LEASE_EXPIRATIONS.inc(len(reaped))
            log.info("requeued %d jobs whose lease expired", len(reaped))

    async def sweep() -> None:
        # Every process schedules a pass; an advisory lock lets one of them run at a time
        # (the others' passes return nothing), so the fleet sweeps once per interval or so.
        swept = await store.jobs.sweep_stranded(hk.sweeper_grace_seconds,
                                                longest_tier_seconds)
        if swept:
            for pool, n in Counter(j.pool for j in swept).items():
                metrics.JOBS_SWEPT.labels(pool).inc(n)
            log.warning("re-published %d waiting jobs that no message carried", len(swept))

    async def expire_reviews() -> None:
        expired = await desk.expire()
        if expired:
            log.info("applied the expiry outcome to %d overdue reviews", expired)

    side.every("lease-reaper", interval, reap, first_after=first_after, critical=True)
    side.every("sweeper", max(interval, hk.sweeper_grace_seconds / 10), sweep,
               first_after=first_after, critical=True)
    side.every("review-timer", interval, expire_reviews, first_after=first_after,
               critical=True)
    _schedule_cleanups(side, store, interval, first_after=first_after)
    schedule_releases(side, hk, first_after=first_after)


def _schedule_cleanups(side: Supervisor, store: Store, interval: float, *,
                       first_after: float) -> None:
    """The streamed outputs' compaction and the key rate buckets' retirement."""

    async def compact_outputs() -> None:
        # A final job's streamed chunks become one text per step (calmq.data.outputs).
        while True:
            jobs, chunks = await store.outputs.compact()
            if jobs:
                log.debug("compacted %d chunks of %d final jobs' streamed output", chunks,
                          jobs)
            if jobs < 500:
                break

    buckets = RateKeys(store)

    async def retire_buckets() -> None:
        # Key rate buckets idle for a day are full again: dropped (calmq.calls.key_rates).
        retired = await buckets.retire_idle()
        if retired:
            log.info("dropped %d key rate buckets idle for a day", retired)

    side.every("output-compaction", max(interval, 2.0), compact_outputs,
               first_after=first_after, critical=True)
    side.every("key-rate-buckets", max(interval, 3600.0), retire_buckets,
               first_after=first_after, critical=True)


def schedule_history_partitions(side: Supervisor, store: Store, settings: Settings, *,
                                interval: float = 300.0) -> None:
    """Every ``interval``: make the time partitions of job_events and job_attempts that the
    next ``history_partitions_ahead`` widths need (calmq.data.partitions). Every worker,
    `calmq reaper` and the API's retention sweep run it: an insert whose time has no
    partition fails, so any one of them keeps the history writable. A pass that finds the
    partitions made (nearly always) reads the catalog and returns."""
    partitions = HistoryPartitions(store)

    async def make() -> None:
        made = await partitions.make_ahead(settings.history_partition_hours,
                                           settings.history_partitions_ahead)
        if made:
            log.info("made %d partitions of the job history ahead of time", made)

    side.every("history-partitions", interval, make, critical=True)


class Reaper:
    """`calmq reaper`: the housekeeping alone, for a fleet scaled to zero workers, under the
    processors' one lifecycle (calmq.supervision): every pass is a critical side task."""

    name = "reaper"

    def __init__(self, settings: Settings, workflows: dict[str, Workflow] | None = None) -> None:
        self.settings = settings
        self.workflows = workflows
        self.life = Lifecycle(self, grace_seconds=0.0)
        self._store: Store | None = None

    async def run(self) -> None:
        await self.life.run()

    async def start(self, life: Lifecycle) -> None:
        s = self.settings
        store = self._store = Store(s.database_url, max_size=2, keep_errors=s.max_job_errors,
                                    **Store.pool_options(s))
        await store.open()
        # The review timer runs here too (and in every worker's housekeeping).
        desk = ReviewDesk(store, self.workflows or load_workflows(s),
                          open_object_store(s.object_store_url))
        # Jobs that waited past a spend cap resume from here too (a fleet scaled to zero).
        hk = housekeeping(s, store, desk.workflows, max(0.5, s.lease_seconds / 3),
                          caps=spend_caps_from_settings(s, SpendLedger(store)))
        schedule_reaper(life.side, hk, desk, longest_tier_seconds=s.retry_tier_list[-1][1])
        schedule_history_partitions(life.side, store, s)

    async def tick(self) -> None:
        return None

    async def drain(self, grace_seconds: float) -> None:
        return None  # a pass in progress is cancelled: its transaction rolls back

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
