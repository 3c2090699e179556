"""The group-commit batcher: shared writes, per-item answers, bounded writers, retries."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import psycopg
import pytest

from calmq.group_commit import GroupCommitter
from calmq.retrying import Backoff
from calmq.storable import refused

FAST = Backoff(initial=0.001, maximum=0.004)


class FakeTable:
    """A store the batcher writes to: records each group, can hold writes or fail them."""

    def __init__(self) -> None:
        self.groups: list[list[str]] = []
        self.rows: list[str] = []
        self.fail_next = 0
        self.bad: set[str] = set()
        self.gate: asyncio.Event | None = None
        self.in_flight = 0
        self.most_in_flight = 0

    async def write(self, group: list[str]) -> Sequence[BaseException | None] | None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            self.groups.append(list(group))
            if self.fail_next:
                self.fail_next -= 1
                raise ConnectionError("database away")
            if self.bad & set(group):
                return [ValueError(f"bad row {i}") if i in self.bad else None for i in group]
            self.rows.extend(group)
            return None
        finally:
            self.in_flight -= 1


async def test_items_within_the_window_share_one_write() -> None:
    """Concurrent submits inside the window are written as one group, each caller answered."""
    table = FakeTable()
    batcher = GroupCommitter("test", table.write, window=0.01, max_batch=100)
    async with asyncio.timeout(5):
        await asyncio.gather(*(batcher.submit(f"job-{i}") for i in range(20)))
    assert table.groups == [[f"job-{i}" for i in range(20)]]
    assert batcher.pending == 0
    await batcher.close()


async def test_each_item_gets_its_own_error() -> None:
    """A write that fails one row fails only that caller; its neighbours succeed."""
    table = FakeTable()
    table.bad = {"b"}
    batcher = GroupCommitter("test", table.write, window=0.01)
    async with asyncio.timeout(5):
        results = await asyncio.gather(*(batcher.submit(x) for x in "abc"),
                                       return_exceptions=True)
    assert results[0] is None
    assert results[2] is None
    assert isinstance(results[1], ValueError)
    await batcher.close()


async def test_a_group_error_without_retry_settles_every_item() -> None:
    """Without retry, an exception of the whole write is every caller's error."""
    table = FakeTable()
    table.fail_next = 1
    batcher = GroupCommitter("test", table.write, window=0.01)
    async with asyncio.timeout(5):
        results = await asyncio.gather(*(batcher.submit(x) for x in "ab"),
                                       return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)
    await batcher.close()


async def test_with_retry_a_failed_group_is_written_again() -> None:
    """With retry, a group whose write raised is written again until it succeeds."""
    table = FakeTable()
    table.fail_next = 2
    batcher = GroupCommitter("test", table.write, window=0.0, retry=FAST)
    async with asyncio.timeout(5):
        await batcher.submit("a")
    assert table.rows == ["a"]
    assert len(table.groups) == 3
    await batcher.close()


async def test_writers_are_bounded_and_later_items_join_the_next_group() -> None:
    """At most ``writers`` groups are written at once; what arrives meanwhile waits and joins
    one larger group, cut at ``max_batch``."""
    table = FakeTable()
    table.gate = asyncio.Event()
    batcher = GroupCommitter("test", table.write, window=0.0, max_batch=3, writers=2)
    for i in range(2):
        batcher.add(f"first-{i}")
        async with asyncio.timeout(5):
            while table.in_flight < i + 1:  # noqa: ASYNC110 - yields to the loop, no clock
                await asyncio.sleep(0)
    for i in range(5):
        batcher.add(f"later-{i}")
    assert batcher.pending == 7
    table.gate.set()
    async with asyncio.timeout(5):
        await batcher.drain()
    assert table.most_in_flight == 2
    assert sorted(len(g) for g in table.groups) == [1, 1, 2, 3]
    assert batcher.pending == 0
    await batcher.close()


async def test_a_caller_that_goes_away_does_not_cancel_the_write() -> None:
    """Cancelling one submit leaves its item (and its neighbours') to be written."""
    table = FakeTable()
    table.gate = asyncio.Event()
    batcher = GroupCommitter("test", table.write, window=0.0)
    gone = asyncio.create_task(batcher.submit("gone"))
    async with asyncio.timeout(5):
        while table.in_flight == 0:  # noqa: ASYNC110 - yields to the loop, no clock
            await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    table.gate.set()
    async with asyncio.timeout(5):
        await batcher.drain()
    assert table.rows == ["gone"]
    await batcher.close()


class RefusingTable(FakeTable):
    """A table whose database refuses a whole group's transaction when one row's data is bad
    (as PostgreSQL refuses a NUL in jsonb): nothing of the group is written."""

    async def write(self, group: list[str]) -> Sequence[BaseException | None] | None:
        self.groups.append(list(group))
        if self.bad & set(group):
            raise psycopg.errors.UntranslatableCharacter("unsupported Unicode escape sequence")
        self.rows.extend(group)
        return None


async def test_a_group_refused_for_one_item_is_split_and_the_rest_written() -> None:
    """With ``refused``, a group the database refuses because of one item is split until that
    item is alone: every other item is written, the bad one settled with its error (the
    ``rejected`` hook for an added item), and the group is not written again forever."""
    table = RefusingTable()
    table.bad = {"job-5"}
    rejected: list[tuple[str, BaseException]] = []
    batcher = GroupCommitter("test", table.write, window=0.01, max_batch=100, retry=FAST,
                      refused=refused, rejected=lambda item, exc: rejected.append((item, exc)))
    for i in range(16):
        batcher.add(f"job-{i}")
    async with asyncio.timeout(5):
        await batcher.drain()
    assert sorted(table.rows) == sorted(f"job-{i}" for i in range(16) if i != 5)
    assert [item for item, _ in rejected] == ["job-5"]
    assert isinstance(rejected[0][1], psycopg.DataError)
    # Halving: the bad item's path is 1 + 2 * log2(16) writes, not one per item.
    assert len(table.groups) <= 1 + 2 * 4
    await batcher.close()


async def test_a_submitted_item_refused_alone_gets_its_error() -> None:
    """A caller whose own item the database refuses gets that error; its neighbours succeed."""
    table = RefusingTable()
    table.bad = {"b"}
    batcher = GroupCommitter("test", table.write, window=0.01, retry=FAST, refused=refused)
    async with asyncio.timeout(5):
        results = await asyncio.gather(*(batcher.submit(x) for x in "abc"),
                                       return_exceptions=True)
    assert results[0] is None
    assert results[2] is None
    assert isinstance(results[1], psycopg.DataError)
    assert sorted(table.rows) == ["a", "c"]
    await batcher.close()
