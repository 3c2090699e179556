"""Claim: admitted requests -> the jobs this process now holds a lease on.

Every job of a batch is claimed in ONE statement (``Jobs.claim``: a conditional UPDATE that
takes a lease and moves ``lease_version`` on, the attempt's fencing token). A request whose
job was not claimed is one of two things:

- **stale**: the job is terminal, cancelled, at another step, or held by a live lease. Its
  message is acknowledged without a model call.
- **not taken yet**: the job is claimable at the message's step (queued or retrying), but
  the claim did not take it: its snapshot was taken a moment before the commit that made
  the job claimable, or this process still runs an attempt of the job whose lease a reaper
  took (the attempt ends at its next heartbeat). Such a message is claimed again
  (``defer``, backing off to once a second) for as long as the job stays claimable, and
  never acknowledged: an acknowledged message would leave the job to the sweeper.
- **out of sight**: the relay publishes a transaction once its commit record is decoded
  from the WAL, a moment before the transaction is visible to other sessions, so a worker
  may poll a job whose row it cannot see yet (or still sees at the previous step, or, after
  a redrive, still as a dead letter). Such a message is claimed again too; only after
  ``OUT_OF_SIGHT_SECONDS`` is it acknowledged (its row was deleted by a retention sweep,
  or it is a stale duplicate of a dead letter). The bound is a time, not a number of
  claims: under load a claim pass takes longer, and a count ran out while the job was
  still waiting for its commit to show.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from calmq.data import Job, Store
from calmq.processors import metrics
from calmq.processors.request import Position, Request
from calmq.retrying import retry_forever
from calmq.workflows import Workflow

__all__ = ["Claim", "Claimed"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Claimed:
    """What a claim took: each request with its job, and when the leases were granted
    (monotonic time the statement was sent: the leases run from after it)."""

    at: float
    jobs: list[tuple[Request, Job]]


# What the claim saw of a job it did not take (``Claim._seen``).
_CLAIMABLE, _OUT_OF_SIGHT, _STALE = "claimable", "out_of_sight", "stale"


class Claim:
    # A job still out of sight this long after its message was first deferred is
    # acknowledged: its row was deleted (a retention sweep), since a published job's row is
    # committed with its event. A job that is claimable is never given up on.
    OUT_OF_SIGHT_SECONDS = 30.0
    # The pause before a deferred message is claimed again: 10 ms, doubling, at most this.
    MAX_DEFER_SECONDS = 1.0
    # A message deferred this long is logged (once per this many seconds).
    WARN_AFTER_SECONDS = 60.0

    def __init__(self, store: Store, *, worker_id: str, lease_seconds: float,
                 workflows: Mapping[str, Workflow], acknowledge: Callable[[Position], None],
                 resubmit: Callable[[Any], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.workflows = workflows
        self.acknowledge = acknowledge
        self.resubmit = resubmit  # hands a deferred message back to the intake
        self._clock = clock
        # message -> (when it was first deferred, times deferred, when it was last logged)
        self._deferred: dict[Position, tuple[float, int, float]] = {}

    async def claim(self, requests: list[Request], running: Callable[[uuid.UUID], bool]
                    ) -> Claimed:
        """Claim the requests' jobs that this process does not run already; acknowledge the
        stale, defer the ahead."""
        steps = {r.job_id: r.step for r in requests}
        ids = {r.job_id for r in requests if not running(r.job_id)}
        started = time.monotonic()  # the leases the claim grants start after this
        jobs: list[Job] = []
        if ids:
            jobs = await retry_forever("claiming a batch failed", lambda: self.store.jobs.claim(
                list(ids), self.worker_id, self.lease_seconds, steps))
            metrics.CLAIM_SECONDS.observe(time.monotonic() - started)
        claimed = {job.id: job for job in jobs}
        claimed_ids = set(claimed)  # a second message for one of them is a duplicate
        unclaimed = [r.job_id for r in requests if r.job_id not in claimed]
        visible = await retry_forever(
            "reading unclaimed jobs failed",
            lambda: self.store.jobs.visible(unclaimed)) if unclaimed else {}
        taken: list[tuple[Request, Job]] = []
        for r in requests:
            job = claimed.pop(r.job_id, None)
            if job is None and r.job_id not in claimed_ids:
                seen = self._seen(r, visible)
                if seen != _STALE and self._defer(r, seen):
                    continue
            self._deferred.pop(r.position, None)
            if job is None:
                # Terminal, cancelled, held by a live lease, or out of sight for good:
                # acknowledge, no model call.
                self.acknowledge(r.position)
                metrics.SKIPPED.inc()
                continue
            taken.append((r, job))
        return Claimed(started, taken)

    def forget(self, position: Position) -> None:
        """The message was acknowledged elsewhere (admission held its job)."""
        self._deferred.pop(position, None)

    def _seen(self, r: Request, visible: Mapping[uuid.UUID, tuple[str, str]]) -> str:
        """What this process sees of the job of a message the claim did not take."""
        seen = visible.get(r.job_id)
        if seen is None:
            return _OUT_OF_SIGHT
        step, status = seen
        if step == r.step and status in ("queued", "retrying"):
            # Claimable now: the claim's snapshot (taken a moment before this read) did not
            # see it yet, or this process still runs an attempt of it whose lease is gone
            # (another worker's claim would have made it running).
            return _CLAIMABLE
        if step == r.step and status == "dead_letter":
            # A redrive's request can outrun the redrive's commit the same way: the worker
            # still sees the dead letter. Acknowledging it would leave the redriven job
            # queued with no message (until the sweeper), so it is claimed again shortly;
            # a true stale duplicate of a dead letter costs OUT_OF_SIGHT_SECONDS.
            return _OUT_OF_SIGHT
        workflow = self.workflows.get(r.workflow)
        if workflow is None:
            return _STALE
        order = [s.name for s in workflow.steps]
        if step in order and r.step in order and order.index(step) < order.index(r.step):
            return _OUT_OF_SIGHT  # still at the step before: the move is not visible yet
        return _STALE

    def _defer(self, r: Request, seen: str) -> bool:
        """Claim the message again shortly; False when it is given up on (out of sight for
        longer than OUT_OF_SIGHT_SECONDS: the caller acknowledges it)."""
        now = self._clock()
        first, tries, logged = self._deferred.get(r.position, (now, 0, now))
        waited = now - first
        if seen == _OUT_OF_SIGHT and waited >= self.OUT_OF_SIGHT_SECONDS:
            log.warning("no job row for the message at %s after %.0f s (%d claims); "
                        "acknowledged", r.position, waited, tries)
            return False
        if now - logged >= self.WARN_AFTER_SECONDS:
            log.warning("the message at %s has waited %.0f s for its job %s (%s) to be "
                        "claimed", r.position, waited, r.job_id, seen)
            logged = now
        tries += 1
        self._deferred[r.position] = (first, tries, logged)
        metrics.CLAIMS_DEFERRED.inc()
        delay = min(0.005 * 2 ** min(tries, 10), self.MAX_DEFER_SECONDS)
        asyncio.get_running_loop().call_later(delay, self.resubmit, r.message)
        return True
