"""The holds' release passes, built from the holds registry (calmq.holds): every pass a hold
declares is scheduled at the pace it declares, running the code below that bears its task's
name, or, for a pass with no code of its own, its release statement alone (the jobs it
returns re-published in its transaction, counted in calmq_wait_resumed_total{reason}).

A worker runs every pass, ``calmq reaper`` every one but the quota's (it meters no tokens),
the batch lane the spend release alone.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass

from calmq.calls import TenantQuota
from calmq.data import Store
from calmq.data.concurrency import ConcurrencyKeys
from calmq.data.fairness import FairQueue
from calmq.data.holds import HeldJobs
from calmq.data.providers import ProviderLedger
from calmq.data.review_caps import ReviewCaps
from calmq.data.spending import SpendLedger
from calmq.holds import Pass, passes
from calmq.processors import metrics
from calmq.processors.admission import concurrency_limits, review_workflows
from calmq.spending import SpendCaps
from calmq.supervision import Supervisor
from calmq.workflows import Workflow, any_timed_wait

__all__ = ["Housekeeping", "Release", "schedule_releases", "schedule_spend_release"]

log = logging.getLogger(__name__)

Run = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Housekeeping:
    """What the release passes of one process read: its store, workflows and paces."""

    store: Store
    workflows: Mapping[str, Workflow]
    interval: float  # the reaper's pace
    lease_seconds: float = 0.0
    sweeper_grace_seconds: float = 0.0
    concurrency_release_batch: int = 256
    concurrency_keys_waiting_max: int = 1000
    caps: SpendCaps | None = None  # None: no spend release here
    quota: TenantQuota | None = None  # None: no quota release here (the spend pass's stale)


@dataclass(frozen=True)
class Release:
    """A pass's code in one process, and whether the workflows use its hold (its ``busy``
    pace applies)."""

    run: Run
    busy: bool = False


Build = Callable[[Housekeeping, Pass, tuple[str, ...]], Release | None]


def _spend(hk: Housekeeping, _p: Pass, _reasons: tuple[str, ...]) -> Release | None:
    return None if hk.caps is None else Release(_spend_run(hk.caps))


def _spend_run(caps: SpendCaps) -> Run:
    async def release() -> None:
        released = await caps.release()
        if released:
            metrics.RELEASED.inc(released)
            log.info("re-published %d jobs that waited past a spend cap", released)

    return release


def _quota(hk: Housekeeping, _p: Pass, _reasons: tuple[str, ...]) -> Release | None:
    # Per tenant, as many of its held jobs as the quota serves in two intervals (interactive
    # first, then oldest): too many come back to wait again, unclaimed; too few leave the
    # quota idle a moment. A tenant whose quota was lifted gets up to 500 a pass.
    quota = hk.quota
    if quota is None:
        return None
    ledger = SpendLedger(hk.store)
    interval = 1.0  # the pace "second"

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

    return Release(release)


def _fair_share_stale(hk: Housekeeping, _p: Pass, _r: tuple[str, ...]) -> Release | None:
    fair = FairQueue(hk.store)

    async def release() -> None:
        # A waiting room's job that no worker held again or picked for the sweeper's grace
        # (fair share turned off, or no worker of its pool left) gets a fresh message.
        released = await fair.release_stale(hk.sweeper_grace_seconds)
        if released:
            for pool, n in Counter(j.pool for j in released).items():
                metrics.JOBS_SWEPT.labels(pool).inc(n)
            log.warning("re-published %d jobs that waited in a waiting room with no worker "
                        "taking them", len(released))

    return Release(release)


def _fair_share_picked(hk: Housekeeping, _p: Pass, _r: tuple[str, ...]) -> Release | None:
    fair = FairQueue(hk.store)

    async def release() -> None:
        # A job picked out of a waiting room whose worker died before claiming it: no
        # message carries it, so back into the room after a lease, for the queue's workers.
        returned = await fair.return_picked(hk.lease_seconds)
        if returned:
            log.warning("returned %d jobs picked from a waiting room and never claimed to "
                        "the room", returned)

    return Release(release)


def _concurrency(hk: Housekeeping, _p: Pass, _r: tuple[str, ...]) -> Release | None:
    keys = ConcurrencyKeys(hk.store, batch=hk.concurrency_release_batch)
    limits = concurrency_limits(hk.workflows)
    known = sorted(hk.workflows)

    async def release() -> None:
        # Jobs held for their concurrency key go back to the work topic as its jobs end
        # (calmq.data.concurrency); the keys' locks make this and the admissions take turns.
        # One pass at a time in the fleet, a batch of keys each, on from the last pass's.
        done = await keys.release(limits, known, hk.lease_seconds,
                                  waiting_max=hk.concurrency_keys_waiting_max)
        if done.jobs:
            metrics.CONCURRENCY_KEY_RESUMED.inc(len(done.jobs))
            log.info("re-published %d jobs held for their concurrency key", len(done.jobs))
        if done.promoted:
            log.info("%d jobs that waited behind their tenant's concurrency keys now wait "
                     "for their own", done.promoted)

    # Busy where a workflow has a limit (a limit of 1 runs one job at a time); elsewhere at
    # the reaper's pace, for jobs whose workflow's limit was removed.
    return Release(release, busy=bool(limits))


def _timed_waits(hk: Housekeeping, _p: Pass, _r: tuple[str, ...]) -> Release | None:
    providers = ProviderLedger(hk.store)

    async def release() -> None:
        # Jobs that waited a set time (their step's models cooling down, calmq.calls.
        # fallback; their key's rate limit, calmq.calls.key_rates) go back to the work topic
        # once it is over; SKIP LOCKED lets every process run it.
        resumed = await providers.release_waited()
        if resumed:
            for reason, n in Counter(reason for _job, reason in resumed).items():
                metrics.WAIT_RESUMED.labels(reason).inc(n)
            log.info("re-published %d jobs whose wait was over", len(resumed))

    # Busy where a step has fallback models or a workflow a key rate limit (the wait ends
    # within the second); else at the reaper's pace: any process may release any job.
    return Release(release, busy=any_timed_wait(hk.workflows))


def _review_cap(hk: Housekeeping, _p: Pass, _r: tuple[str, ...]) -> Release | None:
    caps = ReviewCaps(hk.store)
    reviewed = review_workflows(hk.workflows)

    async def release() -> None:
        # Jobs held for their pool's review cap (calmq.data.review_caps) go back to the
        # work topic as decided reviews make room; one pass at a time per pool (row locks).
        resumed = await caps.release(reviewed)
        if resumed:
            metrics.REVIEW_CAP_RESUMED.inc(len(resumed))
            log.info("re-published %d jobs held for their pool's review cap", len(resumed))

    return Release(release)


def _statement(hk: Housekeeping, p: Pass, reasons: tuple[str, ...]) -> Release | None:
    """A pass whose release is its statement alone."""
    held = HeldJobs(hk.store)

    async def release() -> None:
        resumed = await held.release(p.statement)
        if resumed:
            metrics.WAIT_RESUMED.labels(reasons[0]).inc(len(resumed))
            log.info("re-published %d jobs held for %s", len(resumed), " or ".join(reasons))

    return Release(release, busy=True)


# The passes with code of their own, by task name (tests/unit/test_holds.py: each is a
# registered pass's).
CODE: dict[str, Build] = {
    "spend-release": _spend, "quota-release": _quota,
    "fair-share-stale": _fair_share_stale, "fair-share-picked": _fair_share_picked,
    "concurrency-key-release": _concurrency, "timed-wait-release": _timed_waits,
    "review-cap-release": _review_cap,
}


def _seconds(hk: Housekeeping, p: Pass, busy: bool) -> float:
    if p.pace == "sweeper":
        seconds = max(hk.interval, hk.sweeper_grace_seconds / 10)
    elif p.pace == "spend_refresh":
        assert hk.caps is not None
        seconds = hk.caps.refresh_seconds
    elif p.pace == "second":
        seconds = 1.0
    else:
        seconds = hk.interval
    return min(seconds, p.busy) if busy and p.busy is not None else seconds


def schedule_releases(side: Supervisor, hk: Housekeeping, *, first_after: float = 0.0,
                      only: Collection[str] | None = None) -> None:
    """Every release pass of the holds registry (or those named in ``only``) this process
    can run, as critical side tasks at their declared pace: a process whose release stopped
    strands the jobs it holds."""
    for task, (p, reasons) in passes().items():
        if only is not None and task not in only:
            continue
        release = CODE.get(task, _statement)(hk, p, reasons)
        if release is None:
            continue
        side.every(task, _seconds(hk, p, release.busy), release.run,
                   first_after=0.0 if p.pace == "second" else first_after, critical=True)


def schedule_spend_release(side: Supervisor, caps: SpendCaps, *,
                           first_after: float = 0.0) -> None:
    """The spend release alone, at its declared pace (the batch lane's only hold is a spend
    cap's, set when it packs past one)."""
    task = "spend-release"
    assert passes()[task][0].pace == "spend_refresh"
    side.every(task, caps.refresh_seconds, _spend_run(caps), first_after=first_after,
               critical=True)
