"""Claim: admitted requests -> the jobs this process now holds a lease on.

Every job of a batch is claimed in ONE statement (``Jobs.claim``: a conditional UPDATE that
takes a lease and moves ``lease_version`` on, the attempt's fencing token). A request whose
job was not claimed is one of two things:

- **stale**: the job is terminal, cancelled, at another step, or held by a live lease. Its
  message is acknowledged without a model call.
- **ahead of what this process can see**: the relay publishes a transaction once its commit
  record is decoded from the WAL, a moment before the transaction is visible to other
  sessions, so a worker may poll a job whose row it cannot see yet (or still sees at the
  previous step, or, after a redrive, still as a dead letter). Such a message is claimed
  again shortly (``defer``), never acknowledged as stale; after ``MAX_DEFERRALS`` (~4 s) it
  is acknowledged (its row was deleted by a retention sweep).
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


class Claim:
    # A job still out of sight after this many claims (~4 s) is acknowledged: its row was
    # deleted (a retention sweep), since a published job's row is committed with its event.
    MAX_DEFERRALS = 10

    def __init__(self, store: Store, *, worker_id: str, lease_seconds: float,
                 workflows: Mapping[str, Workflow], acknowledge: Callable[[Position], None],
                 resubmit: Callable[[Any], None]) -> None:
        self.store = store
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.workflows = workflows
        self.acknowledge = acknowledge
        self.resubmit = resubmit  # hands a deferred message back to the intake
        self._deferred: dict[Position, int] = {}  # message -> times deferred

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
            if job is None and r.job_id not in claimed_ids and self._ahead(r, visible):
                self._defer(r)
                continue
            self._deferred.pop(r.position, None)
            if job is None:
                # Terminal, cancelled, or held by a live lease: acknowledge, no model call.
                self.acknowledge(r.position)
                metrics.SKIPPED.inc()
                continue
            taken.append((r, job))
        return Claimed(started, taken)

    def forget(self, position: Position) -> None:
        """The message was acknowledged elsewhere (admission held its job)."""
        self._deferred.pop(position, None)

    def _ahead(self, r: Request, visible: Mapping[uuid.UUID, tuple[str, str]]) -> bool:
        """Whether a message is ahead of what this process can see of its job."""
        seen = visible.get(r.job_id)
        if seen is None:
            return True
        step, status = seen
        if step == r.step and status in ("queued", "retrying"):
            # Claimable now, so the claim's snapshot (taken a moment before this read)
            # did not see it yet; another worker's claim would have made it running.
            return True
        if step == r.step and status == "dead_letter":
            # A redrive's request can outrun the redrive's commit the same way: the worker
            # still sees the dead letter. Acknowledging it would leave the redriven job
            # queued with no message (until the sweeper), so it is claimed again shortly;
            # a true stale duplicate of a dead letter only costs its few deferrals (~4 s).
            return True
        workflow = self.workflows.get(r.workflow)
        if workflow is None:
            return False
        order = [s.name for s in workflow.steps]
        return step in order and r.step in order and order.index(step) < order.index(r.step)

    def _defer(self, r: Request) -> None:
        tries = self._deferred.get(r.position, 0) + 1
        if tries > self.MAX_DEFERRALS:
            self._deferred.pop(r.position, None)
            log.warning("no job row for the message at %s after %d claims; acknowledged",
                        r.position, tries - 1)
            self.acknowledge(r.position)
            metrics.SKIPPED.inc()
            return
        self._deferred[r.position] = tries
        metrics.CLAIMS_DEFERRED.inc()
        asyncio.get_running_loop().call_later(min(0.005 * 2 ** tries, 1.0), self.resubmit,
                                              r.message)
