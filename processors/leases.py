"""Leases: the attempts this process runs, and the leases that let it run them.

Each running attempt is held here with its task, its job and its fencing token (the
claim's ``lease_version``), and when its lease was last known extended. The stage keeps the
leases and ends the attempts that must not go on:

- **heartbeat** (every third of a lease): extends every held lease in one statement; an
  attempt whose lease the database no longer gives it (cancelled job, reaped, or taken by
  another attempt, even of the same worker id restarted) is cancelled;
- **fencing** (``fence_expiring``): a worker whose heartbeats fail stops its attempts itself
  before their leases can run out (5/6 of a lease after the last extension: two failed
  heartbeats and a margin), so no two workers ever run one job; such an attempt ends with
  no outcome and its message is claimed again once the database answers;
- **hand-back**: a stopped attempt's lease is expired at once when the database answers
  again (``hand_back``), and at shutdown every lease still held is (``release_all``), so
  the next claim takes the job without waiting for the lease to run out;
- **batches** (the batch lane): a batch this process creates or collects keeps its own lease
  (``batch_lease_seconds``) while the block of ``keeping_batch`` runs, extended by the same
  schedule every third of that lease, so no other poller takes it meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from calmq.data import Job, Store
from calmq.jobs import Priority
from calmq.processors import metrics
from calmq.retrying import retry_forever
from calmq.supervision import Supervisor

__all__ = ["FENCE_AT", "Leases"]

log = logging.getLogger(__name__)

# An attempt whose lease was last known extended this share of a lease ago is stopped by its
# worker (self-fencing). Heartbeats run every third of a lease, so it takes two failed ones
# in a row; the sixth left is the margin for the cancel to take effect before any other
# worker may claim the job.
FENCE_AT = 5 / 6


@dataclass(slots=True)
class _Held:
    job: Job
    task: asyncio.Task[None]
    extended: float  # monotonic time the claim or heartbeat that last extended it was sent


class Leases:
    def __init__(self, store: Store, *, worker_id: str, lease_seconds: float) -> None:
        self.store = store
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self._held: dict[uuid.UUID, _Held] = {}
        self._tenants: dict[uuid.UUID, int] = {}  # running attempts per tenant
        self._interactive: dict[uuid.UUID, int] = {}  # of them, interactive ones
        self.interactive = 0  # the interactive attempts of all tenants
        # Attempts this process stopped itself (self-fencing): their messages are claimed
        # again once their lease is handed back.
        self._fenced: set[uuid.UUID] = set()
        # The batch lane's batches whose leases this process keeps (by how many holders).
        self._batches: dict[uuid.UUID, int] = {}
        self.batch_lease_seconds = 0.0

    # -- the attempts ----------------------------------------------------------------------

    def hold(self, job: Job, task: asyncio.Task[None], extended: float) -> None:
        self._held[job.id] = _Held(job, task, extended)
        _count(self._tenants, job.tenant_id, 1)
        if job.priority == Priority.INTERACTIVE:
            _count(self._interactive, job.tenant_id, 1)
            self.interactive += 1

    def end(self, job_id: uuid.UUID) -> None:
        """The attempt ended (whatever its outcome)."""
        held = self._held.pop(job_id, None)
        if held is None:
            return
        _count(self._tenants, held.job.tenant_id, -1)
        if held.job.priority == Priority.INTERACTIVE:
            _count(self._interactive, held.job.tenant_id, -1)
            self.interactive -= 1

    def __len__(self) -> int:
        return len(self._held)

    def running(self, job_id: uuid.UUID) -> bool:
        return job_id in self._held

    def job(self, job_id: uuid.UUID) -> Job | None:
        """The job of a running attempt."""
        held = self._held.get(job_id)
        return held.job if held is not None else None

    def held_by(self, tenant_id: uuid.UUID, priority: str | None = None) -> int:
        """How many of the tenant's jobs this process runs now (of ``priority``:
        ``interactive``; None: all)."""
        counts = self._interactive if priority == Priority.INTERACTIVE else self._tenants
        return counts.get(tenant_id, 0)

    def fenced(self, job_id: uuid.UUID) -> bool:
        return job_id in self._fenced

    def stop(self, job_id: uuid.UUID) -> bool:
        """Cancel a running attempt (it ends with no outcome: the batch lane's packed
        attempts once their batch is recorded); False when it is not running."""
        held = self._held.get(job_id)
        if held is None:
            return False
        held.task.cancel()
        return True

    # -- the leases ------------------------------------------------------------------------

    def schedule(self, side: Supervisor, *, batch_lease_seconds: float | None = None) -> None:
        """Heartbeat every third of a lease, and stop the attempts whose leases could not be
        extended for most of one (self-fencing: its own task, so that a heartbeat hanging on
        an unreachable database cannot keep attempts running past their leases). Both are
        critical: without them leases would lapse under running attempts. With
        ``batch_lease_seconds`` (the batch lane), the batches' heartbeat too."""
        interval = max(0.2, self.lease_seconds / 3)
        side.every("lease-heartbeat", interval, self.heartbeat, first_after=interval,
                   critical=True)
        fence = max(0.1, self.lease_seconds / 12)
        side.every("lease-fence", fence, self.fence_expiring, first_after=fence,
                   critical=True)
        if batch_lease_seconds is not None:
            self.batch_lease_seconds = batch_lease_seconds
            beat = batch_lease_seconds / 3
            side.every("batch-lease-heartbeat", beat, self.keep_batches, first_after=beat,
                       critical=True)

    @contextlib.contextmanager
    def keeping_batch(self, key: uuid.UUID) -> Iterator[None]:
        """Keep the lease of batch ``key`` while the block runs (a create's upload, a
        collect's results: minutes for 200 MB)."""
        _count(self._batches, key, 1)
        try:
            yield
        finally:
            _count(self._batches, key, -1)

    async def keep_batches(self) -> None:
        """Extend the lease of every batch kept (``keeping_batch``); a failed extension is
        tried again on the next beat."""
        await asyncio.gather(*(self._keep_batch(key) for key in list(self._batches)))

    async def _keep_batch(self, key: uuid.UUID) -> None:
        try:
            if not await self.store.batches.heartbeat(key, self.worker_id,
                                                      self.batch_lease_seconds):
                log.warning("lost the lease of batch %s while keeping it", key)
        except Exception as exc:  # noqa: BLE001 - the next beat tries again
            log.warning("keeping the lease of batch %s failed: %s", key, exc)

    async def heartbeat(self) -> None:
        """Extend the leases of running attempts; stop the ones this process no longer holds."""
        leases = {job_id: h.job.lease_version for job_id, h in self._held.items()
                  if job_id not in self._fenced}
        if not leases:
            return
        sent = time.monotonic()  # the extended leases run from after this
        kept = await self.store.jobs.heartbeat(leases, self.worker_id, self.lease_seconds)
        for job_id, version in leases.items():
            held = self._held.get(job_id)
            if held is None or held.job.lease_version != version:
                continue  # ended meanwhile (or its job was claimed again since)
            if job_id in kept:
                held.extended = sent
            elif job_id not in self._fenced:
                held.task.cancel()
                metrics.ABORTED.inc()

    async def fence_expiring(self) -> int:
        """Self-fencing: stop every attempt whose lease may run out soon because this
        process could not extend it (its heartbeats failed: the database is away or too
        slow), before any other worker may claim the job. Returns how many it stopped."""
        limit = self.lease_seconds * FENCE_AT
        now = time.monotonic()
        stopped = 0
        for job_id, held in list(self._held.items()):
            since = now - held.extended
            if since < limit or job_id in self._fenced:
                continue
            self._fenced.add(job_id)
            held.task.cancel()
            stopped += 1
            metrics.FENCED.labels("heartbeat_failed").inc()
            log.warning("stopping attempt of %s: its lease was last extended %.1f s ago "
                        "(lease %.1f s) and may be taken over", job_id, since,
                        self.lease_seconds, extra={"job_id": str(job_id)})
        return stopped

    async def hand_back(self, job: Job) -> None:
        """Expire a self-fenced attempt's lease at once if it is still this attempt's (the
        database answered again before it ran out), so the next claim need not wait."""
        try:
            await retry_forever(
                "handing back the lease of a stopped attempt failed",
                lambda: self.store.jobs.release_leases({job.id: job.lease_version},
                                                       self.worker_id))
        finally:
            self._fenced.discard(job.id)

    async def release_all(self) -> int:
        """Stop every running attempt and hand its lease back (shutdown: the grace period
        ran out). Returns how many were running."""
        held = dict(self._held)
        leases = {job_id: h.job.lease_version for job_id, h in held.items()}
        for h in held.values():
            h.task.cancel()
        if held:
            await asyncio.gather(*(h.task for h in held.values()), return_exceptions=True)
            try:
                await self.store.jobs.release_leases(leases, self.worker_id)
            except Exception:
                log.exception("releasing %d leases failed", len(held))
        return len(held)


def _count(counts: dict[uuid.UUID, int], tenant_id: uuid.UUID, by: int) -> None:
    left = counts.get(tenant_id, 0) + by
    if left > 0:
        counts[tenant_id] = left
    else:
        counts.pop(tenant_id, None)
