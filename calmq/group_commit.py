"""Group commit: items that arrive within a few milliseconds share one write.

Used for accepted submits (producers/intake.py), step outcomes (processors/commit.py) and
model usage (calmq/calls/budget.py): one transaction, one WAL flush, for many items, which is most
of what lets calmq keep up with a plain ``SKIP LOCKED`` queue while doing more per job.

The shape: ``add`` (fire and forget) or ``submit`` (wait for the item's own result) queue an
item; after ``window`` seconds (0: at once) the queue is cut into groups of at most
``max_batch`` and written by up to ``writers`` concurrent writers. What arrives while every
writer is busy waits for the next free one and so joins a larger group, which is how the
group size follows the load. ``write`` returns None (every item written) or one error (or
None) per item, so that one bad row fails only its own request. With ``retry`` set, a group
whose write raised is written again (jittered backoff) until it succeeds: for work that must
not be dropped while the database is away; without it the error settles every item.

A group can also fail because of one of its items: text PostgreSQL refuses (a NUL, a lone
surrogate), a value out of range. Written again, it fails again, forever, and with it every
other item of the group (the committer's groups hold up to 250 outcomes of any tenants).
With ``refused`` (a predicate on the error: calmq.storable.refused) such a group is split
in halves and each half written on its own, down to the one item that fails alone; that
item is settled with its error (its caller's future, or the ``rejected`` hook for an item
that was added, not submitted) and the rest are written. A group is never retried forever
because of one item.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from prometheus_client import Counter

from calmq.retrying import Backoff, retry_forever

__all__ = ["GroupCommitter", "GroupWrite"]

log = logging.getLogger(__name__)

_Item = TypeVar("_Item")

# Writes one group; returns None if all of it is written, else one error (or None) per item.
GroupWrite = Callable[[list[_Item]], Awaitable[Sequence[BaseException | None] | None]]

# Items a group write settled with an error of their own (the database refused that item
# alone), by batcher: each is an outcome, accept or usage row that was not written.
REFUSED = Counter("calmq_group_write_refused_total",
                  "Items of a group write that the database refused on their own, by batcher",
                  ["batcher"])


class _Refusal:
    """A write that failed because of its items (``GroupCommitter.refused``): split, not retried."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class GroupCommitter(Generic[_Item]):
    """Collects items and writes them in groups with ``write`` (see the module docstring);
    ``name`` names its task, and its retries in the log and the metrics."""

    def __init__(self, name: str, write: GroupWrite[_Item], *, window: float = 0.0,
                 max_batch: int = 256, writers: int = 1, retry: Backoff | None = None,
                 refused: Callable[[BaseException], bool] | None = None,
                 rejected: Callable[[_Item, BaseException], None] | None = None) -> None:
        self.name = name
        self._write = write
        self.window = window
        self.max_batch = max_batch
        self.retry = retry
        # Whether an error is the group's data's fault (split the group), and what to do
        # with an added item refused alone (see the module docstring).
        self.refused = refused
        self.rejected = rejected
        # Queued items, and beside each the future of its caller (None: added, nobody
        # waits). Two lists, not a list of pairs: ``add`` is on the worker's hot path.
        self._pending: list[_Item] = []
        self._futures: list[asyncio.Future[None] | None] = []
        self._writing = 0
        self._slots = asyncio.Semaphore(writers)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set by the writer that leaves nothing pending
        self._task: asyncio.Task[None] | None = None
        self._writers: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Start the writing loop (``add`` and ``submit`` start it too, on first use)."""
        self._task = asyncio.create_task(self._loop(), name=self.name)

    @property
    def pending(self) -> int:
        """Items not yet written (queued, or in a write under way)."""
        return len(self._pending) + self._writing

    def add(self, item: _Item) -> None:
        if self._task is None:
            self.start()
        self._pending.append(item)
        self._futures.append(None)
        self._wake.set()

    async def submit(self, item: _Item) -> None:
        """Return once ``item`` is written; raise its error if it was not."""
        # Shielded: a caller that goes away (a client hung up, a step timed out) must not
        # cancel the write its neighbours share.
        await asyncio.shield(self.queue(item))

    def queue(self, item: _Item) -> asyncio.Future[None]:
        """Queue ``item`` and return its future, settled once it is written: for a caller
        that waits later, or only for the last of its items (with one writer, groups are
        written in the order their items came)."""
        if self._task is None:
            self.start()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # An error nobody waits for (an item before the last) is not logged as unretrieved.
        future.add_done_callback(_retrieve)
        self._pending.append(item)
        self._futures.append(future)
        self._wake.set()
        return future

    async def drain(self) -> None:
        """Wait until everything queued is written."""
        while self.pending:
            self._idle.clear()
            await self._idle.wait()

    async def close(self, grace: float = 5.0) -> None:
        """Write what is queued (for up to ``grace`` seconds), then stop."""
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self.drain()
        for task in (self._task, *self._writers):
            task.cancel()
        await asyncio.gather(self._task, *self._writers, return_exceptions=True)
        self._task = None

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            if self.window:
                await asyncio.sleep(self.window)  # let concurrent items join this group
            self._wake.clear()
            while self._pending:
                await self._slots.acquire()
                group = self._pending[: self.max_batch]
                futures = self._futures[: len(group)]
                del self._pending[: len(group)], self._futures[: len(group)]
                self._writing += len(group)
                task = asyncio.create_task(self._write_group(group, futures))
                self._writers.add(task)
                task.add_done_callback(self._writers.discard)

    async def _write_group(self, group: list[_Item],
                           futures: list[asyncio.Future[None] | None]) -> None:
        try:
            errors = await self.write_group(group)
            if self.rejected is not None and errors is not None:
                for item, future, error in zip(group, futures, errors, strict=True):
                    if error is not None and future is None:
                        self.rejected(item, error)
        except BaseException as exc:
            _settle(futures, [exc] * len(group))
            if not isinstance(exc, Exception):
                raise  # cancelled (shutdown): every waiter has been told
            log.warning("%s: a group of %d failed: %s", self.name, len(group), exc)
        else:
            _settle(futures, errors)
        finally:
            self._writing -= len(group)
            self._slots.release()
            if not self._pending and not self._writing:
                self._idle.set()


    async def write_group(self, group: list[_Item]) -> Sequence[BaseException | None] | None:
        """Write ``group`` now, outside the queue (again while the database is away, with
        ``retry``); a group the database refuses because of its data is split until each
        refusal is one item's. Returns None (all written) or one error (or None) per item."""
        refused = self.refused

        async def once() -> Sequence[BaseException | None] | _Refusal | None:
            try:
                return await self._write(group)
            except Exception as exc:
                if refused is not None and refused(exc):
                    return _Refusal(exc)
                raise

        if self.retry is not None:
            result = await retry_forever(f"{self.name}: writing a group failed", once,
                                         backoff=self.retry)
        else:
            result = await once()
        if not isinstance(result, _Refusal):
            return result
        if len(group) == 1:
            REFUSED.labels(self.name).inc()
            log.error("%s: the database refused an item on its own, settled without being "
                      "written: %s", self.name, result.error)
            return [result.error]
        log.warning("%s: the database refused a group of %d (%s); writing it in halves to "
                    "find the item at fault", self.name, len(group), type(result.error).__name__)
        half = len(group) // 2
        first = await self.write_group(group[:half])
        second = await self.write_group(group[half:])
        if first is None and second is None:
            return None
        return [*(first or [None] * half), *(second or [None] * (len(group) - half))]


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def _settle(futures: list[asyncio.Future[None] | None],
            errors: Sequence[BaseException | None] | None) -> None:
    if not any(futures):  # added, not submitted: nobody waits (the committer)
        return
    for index, future in enumerate(futures):
        if future is None or future.done():
            continue
        error = errors[index] if errors is not None else None
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
