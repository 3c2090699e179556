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
one text per step.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter

from calmq.calls import TenantQuota
from calmq.data import Store
from calmq.data.concurrency import ConcurrencyKeys
from calmq.data.fairness import FairQueue
from calmq.data.partitions import HistoryPartitions
from calmq.data.providers import ProviderLedger
from calmq.data.rate_keys import RateKeys
from calmq.data.review_caps import ReviewCaps
from calmq.data.spending import SpendLedger
from calmq.errors import FailureClass
from calmq.objects import open_object_store
from calmq.processors import metrics
from calmq.processors.admission import concurrency_limits, review_workflows
from calmq.reviews import ReviewDesk
from calmq.settings import Settings
from calmq.spending import SpendCaps, spend_caps_from_settings
from calmq.supervision import Lifecycle, Supervisor
from calmq.workflows import Workflow, any_timed_wait, load_workflows

__all__ = ["POISON_ERROR", "Reaper", "schedule_history_partitions", "schedule_quota_release",
           "schedule_reaper", "schedule_spend_release"]

log = logging.getLogger(__name__)

# The contract has no poison failure class: a job whose input kills its worker is treated
# as poison input (class input, not retried), as processors/poison.py treats an unreadable
# message, with its own code.
POISON_ERROR: dict[str, str] = {
    "code": "poison", "class": FailureClass.INPUT.value,
    "message": "every attempt ended with its worker (killed, out of memory?) before an"
               " outcome was written, up to the attempt budget; not run again"}


def schedule_reaper(side: Supervisor, store: Store, desk: ReviewDesk, interval: float, *,
                    sweeper_grace_seconds: float, longest_tier_seconds: float,
                    lease_seconds: float, concurrency_release_batch: int = 256,
                    concurrency_keys_waiting_max: int = 1000,
                    first_after: float = 0.0) -> None:
    """Run the reaper, the sweeper and the review timer under ``side`` (the reaper and the
    timer every ``interval`` seconds, the sweeper every tenth of its grace at most that
    often), as critical tasks: a process whose reaper stopped must not look healthy."""

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
        swept = await store.jobs.sweep_stranded(sweeper_grace_seconds, longest_tier_seconds)
        if swept:
            for pool, n in Counter(j.pool for j in swept).items():
                metrics.JOBS_SWEPT.labels(pool).inc(n)
            log.warning("re-published %d waiting jobs that no message carried", len(swept))

    _schedule_fair_share(side, store, interval, first_after=first_after,
                         lease_seconds=lease_seconds,
                         sweeper_grace_seconds=sweeper_grace_seconds)

    keys = ConcurrencyKeys(store, batch=concurrency_release_batch)
    limits = concurrency_limits(desk.workflows)

    async def release_concurrency_keys() -> None:
        # Jobs held for their concurrency key go back to the work topic as its jobs end
        # (calmq.data.concurrency); the keys' locks make this and the admissions take turns.
        # One pass at a time in the fleet, a batch of keys each, on from the last pass's.
        done = await keys.release(limits, sorted(desk.workflows), lease_seconds,
                                  waiting_max=concurrency_keys_waiting_max)
        if done.jobs:
            metrics.CONCURRENCY_KEY_RESUMED.inc(len(done.jobs))
            log.info("re-published %d jobs held for their concurrency key", len(done.jobs))
        if done.promoted:
            log.info("%d jobs that waited behind their tenant's concurrency keys now wait "
                     "for their own", done.promoted)

    async def expire_reviews() -> None:
        expired = await desk.expire()
        if expired:
            log.info("applied the expiry outcome to %d overdue reviews", expired)

    caps = ReviewCaps(store)
    reviewed = review_workflows(desk.workflows)

    async def release_review_cap_holds() -> None:
        # Jobs held for their pool's review cap (calmq.data.review_caps) go back to the
        # work topic as decided reviews make room; one pass at a time per pool (row locks).
        resumed = await caps.release(reviewed)
        if resumed:
            metrics.REVIEW_CAP_RESUMED.inc(len(resumed))
            log.info("re-published %d jobs held for their pool's review cap", len(resumed))

    async def compact_outputs() -> None:
        # A final job's streamed chunks become one text per step (calmq.data.outputs).
        while True:
            jobs, chunks = await store.outputs.compact()
            if jobs:
                log.debug("compacted %d chunks of %d final jobs' streamed output", chunks,
                          jobs)
            if jobs < 500:
                break

    side.every("output-compaction", max(interval, 2.0), compact_outputs,
               first_after=first_after, critical=True)
    side.every("review-cap-release", interval, release_review_cap_holds,
               first_after=first_after, critical=True)
    side.every("lease-reaper", interval, reap, first_after=first_after, critical=True)
    side.every("sweeper", max(interval, sweeper_grace_seconds / 10), sweep,
               first_after=first_after, critical=True)
    side.every("review-timer", interval, expire_reviews, first_after=first_after,
               critical=True)
    # Often where a workflow has a limit: a key's next job waits for this pass (a limit of 1
    # runs one job at a time). Elsewhere at the reaper's pace, for jobs whose workflow's
    # limit was removed.
    side.every("concurrency-key-release", min(interval, 0.2) if limits else interval,
               release_concurrency_keys, first_after=first_after, critical=True)
    _schedule_timed_waits(side, store, desk, interval, first_after=first_after)


def _schedule_timed_waits(side: Supervisor, store: Store, desk: ReviewDesk, interval: float,
                          *, first_after: float) -> None:
    """Jobs that wait a set time (model cooldowns, key rate limits) and the key rate
    buckets' housekeeping (calmq.rate_keys)."""
    providers = ProviderLedger(store)

    async def release_waited() -> None:
        # Jobs that waited a set time (their step's models cooling down, calmq.fallback;
        # their key's rate limit, calmq.rate_keys) go back to the work topic once it is
        # over; SKIP LOCKED lets every process run it.
        resumed = await providers.release_waited()
        if resumed:
            for reason, n in Counter(reason for _job, reason in resumed).items():
                metrics.WAIT_RESUMED.labels(reason).inc(n)
            log.info("re-published %d jobs whose wait was over", len(resumed))

    buckets = RateKeys(store)

    async def retire_buckets() -> None:
        # Key rate buckets idle for a day are full again: dropped (calmq.rate_keys).
        retired = await buckets.retire_idle()
        if retired:
            log.info("dropped %d key rate buckets idle for a day", retired)

    side.every("key-rate-buckets", max(interval, 3600.0), retire_buckets,
               first_after=first_after, critical=True)
    # Often where a step has fallback models or a workflow a key rate limit (the wait ends
    # within the second), else at the reaper's pace: any process may release any job, so
    # some worker always does.
    side.every("timed-wait-release", min(interval, 0.5) if any_timed_wait(desk.workflows)
               else interval, release_waited, first_after=first_after, critical=True)


def _schedule_fair_share(side: Supervisor, store: Store, interval: float, *,
                         first_after: float, lease_seconds: float,
                         sweeper_grace_seconds: float) -> None:
    """The waiting rooms' safety nets (calmq.data.fairness): jobs no message carries."""
    fair = FairQueue(store)

    async def release_stale_fair_share() -> None:
        # A waiting room's job that no worker held again or picked for the sweeper's grace
        # (fair share turned off, or no worker of its pool left) gets a fresh message.
        released = await fair.release_stale(sweeper_grace_seconds)
        if released:
            for pool, n in Counter(j.pool for j in released).items():
                metrics.JOBS_SWEPT.labels(pool).inc(n)
            log.warning("re-published %d jobs that waited in a waiting room with no worker "
                        "taking them", len(released))

    async def return_picked() -> None:
        # A job picked out of a waiting room whose worker died before claiming it: no
        # message carries it, so back into the room after a lease, for the lane's workers.
        returned = await fair.return_picked(lease_seconds)
        if returned:
            log.warning("returned %d jobs picked from a waiting room and never claimed to "
                        "the room", returned)

    side.every("fair-share-stale", max(interval, sweeper_grace_seconds / 10),
               release_stale_fair_share, first_after=first_after, critical=True)
    side.every("fair-share-picked", interval, return_picked, first_after=first_after,
               critical=True)


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


def schedule_spend_release(side: Supervisor, caps: SpendCaps, *,
                           first_after: float = 0.0) -> None:
    """Every ``spend_cap_refresh_seconds``: re-publish the jobs that waited past a spend cap
    and that no cap holds any more (the window rolled over, the cap was raised). One pass
    at a time in the fleet (an advisory lock); a pass releases at most 500 jobs."""

    async def release() -> None:
        released = await caps.release()
        if released:
            metrics.RELEASED.inc(released)
            log.info("re-published %d jobs that waited past a spend cap", released)

    side.every("spend-release", caps.refresh_seconds, release, first_after=first_after,
               critical=True)


def schedule_quota_release(side: Supervisor, ledger: SpendLedger, quota: TenantQuota, *,
                           interval: float = 1.0, first_after: float = 0.0) -> None:
    """Every ``interval``: re-publish, per tenant, as many of the jobs that wait for its
    token quota as the quota serves in two intervals (interactive first, then oldest).
    Too many come back to wait again, unclaimed; too few leave the quota idle a moment.
    A tenant whose quota was lifted gets up to 500 a pass."""

    async def release() -> None:
        tenants = await ledger.quota_held_tenants()
        if not tenants:
            return
        limits: dict[uuid.UUID, int] = {}
        for tenant in tenants:
            per_minute = await quota.per_minute(tenant)
            limits[tenant] = quota.serves(per_minute, 2 * interval) if per_minute > 0 else 500
        released = await ledger.release_quota(limits)
        if released:
            metrics.RELEASED.inc(len(released))

    side.every("quota-release", interval, release, first_after=first_after, critical=True)


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
        schedule_reaper(life.side, store, desk, max(0.5, s.lease_seconds / 3),
                        lease_seconds=s.lease_seconds,
                        concurrency_release_batch=s.concurrency_release_batch,
                        concurrency_keys_waiting_max=s.concurrency_keys_waiting_max,
                        sweeper_grace_seconds=s.sweeper_grace_seconds,
                        longest_tier_seconds=s.retry_tier_list[-1][1])
        # Jobs that waited past a spend cap resume from here too (a fleet scaled to zero).
        schedule_spend_release(life.side, spend_caps_from_settings(s, SpendLedger(store)))
        schedule_history_partitions(life.side, store, s)

    async def tick(self) -> None:
        return None

    async def drain(self, grace_seconds: float) -> None:
        return None  # a pass in progress is cancelled: its transaction rolls back

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
