"""Commit: attempt outcomes -> PostgreSQL, then their offsets -> done.

The group commit of outcomes (calmq.group_commit.GroupCommitter): those that finish within a few ms
share one transaction (status, history, attempt rows, outbox), and only once it committed
are their offsets marked done, so the consumer thread commits a message's offset only after
its outcome is durable.

Up to ``writers`` groups are written at once on separate connections: with hundreds of
calls ending together, one serial writer became the ceiling of a worker's throughput (a
group's transaction costs a few ms per outcome), while groups never touch the same job row,
so they do not contend. A group is written again until the database takes it: dropping it
would leave its offsets pending for good. An outcome the database did not move (its attempt
lost the lease) is done too: its job belongs to another attempt, with its own message; one
whose data the database refuses is split out of its group and dropped (calmq.storable).
"""

from __future__ import annotations

import logging
import time

from calmq.data import Finish, Store
from calmq.group_commit import GroupCommitter
from calmq.job_costs import count_accepted
from calmq.processors import metrics
from calmq.processors.offsets import OffsetTracker
from calmq.processors.request import Position
from calmq.retrying import RECONNECT
from calmq.storable import refused

__all__ = ["Committer"]

log = logging.getLogger(__name__)


class Committer:
    def __init__(
        self, store: Store, tracker: OffsetTracker, *, window: float = 0.004,
        max_batch: int = 250, writers: int = 4,
    ) -> None:
        self.store = store
        self.tracker = tracker
        # A group the database refuses because of one outcome's data is split until that
        # outcome is alone (calmq.group_commit); it is then dropped, its offset marked done.
        self._batcher: GroupCommitter[tuple[Finish, Position]] = GroupCommitter(
            "committer", self._write, window=window, max_batch=max_batch, writers=writers,
            retry=RECONNECT, refused=refused, rejected=self._refused)

    def start(self) -> None:
        self._batcher.start()

    def add(self, finish: Finish, position: Position) -> None:
        self._batcher.add((finish, position))

    @property
    def pending(self) -> int:
        """Outcomes not yet durable (queued, or in the transaction being written)."""
        return self._batcher.pending

    async def _write(self, group: list[tuple[Finish, Position]]) -> None:
        started = time.monotonic()
        moved = await self.store.attempts.finish([f for f, _ in group])
        count_accepted(moved.accepted)  # the cost per accepted job
        for finish, (tp, offset) in group:
            self.tracker.done(tp, offset)
            if finish.job_id in moved:
                metrics.finished(finish.status, finish.error)
            else:
                log.warning("the outcome of attempt %d of %s was refused: the attempt no "
                            "longer held the job", finish.attempt, finish.job_id)
                metrics.FENCED.labels("stale_outcome").inc()
        metrics.GROUP_WRITE_SECONDS.observe(time.monotonic() - started)
        metrics.GROUP_SIZE.observe(len(group))

    def _refused(self, item: tuple[Finish, Position], error: BaseException) -> None:
        """An outcome the database refused on its own (what the attempt's storable check
        did not catch): never written again. Its offset is done, so its partition commits
        on; the job's lease runs out and the reaper requeues it."""
        finish, (tp, offset) = item
        log.error("the outcome of attempt %d of %s could not be stored and was dropped: %s",
                  finish.attempt, finish.job_id, error)
        self.tracker.done(tp, offset)

    async def drain(self) -> None:
        await self._batcher.drain()
