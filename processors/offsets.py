"""Per-partition offset tracking: offsets complete out of order; only the contiguous
completed prefix is committed, so a crash never skips a message still in flight."""

from __future__ import annotations

import heapq
import json
import logging
import threading
import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

__all__ = ["OffsetTracker", "Position", "commit_prefix", "headers_of", "position_of"]

log = logging.getLogger(__name__)

Position = tuple[tuple[str, int], int]  # ((topic, partition), offset)


def position_of(msg: Message) -> Position:
    """Where a fetched message sits; a fetched message always has all three."""
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError("an error event is not a message with a position")
    return (topic, partition), offset


CONNECTOR_HEADERS = "calmq-headers"


def headers_of(msg: Message) -> list[tuple[str, bytes | None]]:
    """A message's headers as (name, bytes) pairs, the shape calmq.kafka.header reads.

    The Debezium connector (``deploy/debezium``) carries the outbox ``headers`` column as one
    ``calmq-headers`` header (a JSON object); it is spread into one header per key, as the
    relay publishes them, so retry bookkeeping and ``traceparent`` read the same either way.
    """
    raw = msg.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    out = [(k, v.encode() if isinstance(v, str) else v) for k, v in pairs]
    packed = [v for k, v in out if k == CONNECTOR_HEADERS and v is not None]
    if not packed:
        return out
    out = [(k, v) for k, v in out if k != CONNECTOR_HEADERS]
    present = {k for k, _ in out}
    for blob in packed:
        try:
            extra = json.loads(blob)
        except ValueError:
            log.warning("ignoring a %s header that is not JSON", CONNECTOR_HEADERS)
            continue
        if isinstance(extra, str):  # a converter that wrote the JSON column as a JSON string
            try:
                extra = json.loads(extra)
            except ValueError:
                continue
        if not isinstance(extra, dict):
            log.warning("ignoring a %s header that is not a JSON object", CONNECTOR_HEADERS)
            continue
        out += [(str(k), str(v).encode()) for k, v in extra.items()
                if str(k) not in present and v is not None]
    return out


class _Partition:
    __slots__ = ("done_at", "heap", "highest", "pending")

    def __init__(self) -> None:
        self.pending: set[int] = set()
        self.heap: list[int] = []
        self.highest = -1
        self.done_at: dict[int, float] = {}  # completed, not yet committed -> when

    def commit_position(self) -> int | None:
        while self.heap and self.heap[0] not in self.pending:
            heapq.heappop(self.heap)
        if self.heap:
            return self.heap[0]  # the oldest message still in flight
        return self.highest + 1 if self.highest >= 0 else None


class OffsetTracker:
    """Thread-safe: the consumer thread adds and commits, the asyncio loop completes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._parts: dict[tuple[str, int], _Partition] = {}
        self._committed: dict[tuple[str, int], int] = {}

    def assign(self, tp: tuple[str, int]) -> None:
        with self._lock:
            self._parts.setdefault(tp, _Partition())

    def revoke(self, tp: tuple[str, int]) -> None:
        with self._lock:
            self._parts.pop(tp, None)
            self._committed.pop(tp, None)

    def add(self, tp: tuple[str, int], offset: int) -> None:
        with self._lock:
            part = self._parts.setdefault(tp, _Partition())
            part.pending.add(offset)
            heapq.heappush(part.heap, offset)
            part.highest = max(part.highest, offset)

    def done(self, tp: tuple[str, int], offset: int) -> None:
        with self._lock:
            part = self._parts.get(tp)
            if part is not None:  # a revoked partition's late completion: nothing to commit
                part.pending.discard(offset)
                part.done_at[offset] = self._clock()

    def in_flight(self) -> int:
        with self._lock:
            return sum(len(p.pending) for p in self._parts.values())

    def to_commit(self, only: set[tuple[str, int]] | None = None) -> dict[tuple[str, int], int]:
        """Positions that moved since the last commit (the next offset to read, as Kafka wants)."""
        out = {}
        with self._lock:
            for tp, part in self._parts.items():
                if only is not None and tp not in only:
                    continue
                position = part.commit_position()
                if position is not None and position > self._committed.get(tp, -1):
                    out[tp] = position
        return out

    def committed(self, positions: dict[tuple[str, int], int]) -> float | None:
        """Record a commit; returns the commit lag: seconds since the oldest completion it
        covered finished (None when it covered no completion)."""
        oldest: float | None = None
        with self._lock:
            for tp, position in positions.items():
                part = self._parts.get(tp)
                if part is None:
                    continue
                self._committed[tp] = position
                covered = [o for o in part.done_at if o < position]
                for o in covered:
                    at = part.done_at.pop(o)
                    oldest = at if oldest is None else min(oldest, at)
        return None if oldest is None else self._clock() - oldest


def commit_prefix(
    consumer: Consumer, tracker: OffsetTracker, only: set[tuple[str, int]] | None = None,
    *, asynchronous: bool = False,
) -> float | None:
    """Commit the completed prefix of each partition (``only`` some); returns the commit lag.

    ``asynchronous`` returns at once (None): the consumer's ``on_commit`` callback then
    records the commit with ``tracker.committed``. A failed commit is not fatal: the same
    prefix, or a longer one, goes with the next.
    """
    positions = tracker.to_commit(only)
    if not positions:
        return None
    offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items()]
    try:
        if asynchronous:
            consumer.commit(offsets=offsets, asynchronous=True)
        else:
            consumer.commit(offsets=offsets, asynchronous=False)
    except KafkaException as exc:
        log.warning("offset commit failed: %s", exc)
        return None
    return None if asynchronous else tracker.committed(positions)
