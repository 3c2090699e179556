"""One LISTEN connection per API process, fanned out to whoever waits on a channel or a job.

The job_events trigger (migration 0004) sends ``NOTIFY calmq_job_events, '<id>,<id>,...'``
(the jobs that got an event in one statement);
SSE streams wait on their job's id here instead of polling the table. Other channels
(``calmq_webhooks``, ``calmq_api_keys``) wake a waiter keyed by the channel name.
A streamed step's text comes on ``calmq_job_output`` (calmq.data.outputs: each payload a
group of chunks, the text in it when it fits NOTIFY's 8,000 bytes): the chunks of a job
some stream follows go to its ``OutputFeed``, in order, and wake it; nobody reads the
table for them.
If the connection drops, every waiter is woken (so streams re-read the table) and the hub
reconnects with a short backoff; TCP keepalives (calmq.data.database.LISTEN_KEEPALIVES) make
a connection whose server vanished without a word drop too, instead of waiting for ever.
Workers announce a job's text only while a stream follows it (the route's
``Outputs.follow``), so this loop is not handed every token the fleet streams.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from collections.abc import Callable

import psycopg

from calmq.data.database import listen_connection
from calmq.data.outputs import CHANNEL as OUTPUT
from calmq.data.outputs import OutputChunk, parse_payload
from calmq.retrying import Reconnect

__all__ = ["JOB_EVENTS", "KEYS", "OUTPUT", "WEBHOOKS", "Hub", "OutputFeed"]

JOB_EVENTS = "calmq_job_events"
WEBHOOKS = "calmq_webhooks"
KEYS = "calmq_api_keys"

# Chunks one feed holds for a stream that has not written them yet: a client reading
# slower than the model writes falls back to reading the table.
_FEED_LIMIT = 1024


class OutputFeed:
    """The chunks of one job announced while a stream follows it, in the order they came.
    ``gap``: some were dropped (the client fell behind, or the LISTEN connection was lost),
    so the stream reads the table instead."""

    def __init__(self, wake: asyncio.Event) -> None:
        self.wake = wake
        self.chunks: deque[OutputChunk] = deque()
        self.gap = False
        # A job event came too (or the connection was lost): the history must be read.
        self.events = True

    def push(self, chunk: OutputChunk) -> None:
        if len(self.chunks) >= _FEED_LIMIT:
            self.chunks.clear()
            self.gap = True
        else:
            self.chunks.append(chunk)
        self.wake.set()

    def take_events(self) -> bool:
        """Whether a job event came since the last call."""
        events, self.events = self.events, False
        return events

    def take(self) -> tuple[list[OutputChunk], bool]:
        """The chunks that came since the last take, and whether any were dropped."""
        chunks, gap = list(self.chunks), self.gap
        self.chunks.clear()
        self.gap = False
        return chunks, gap


class Hub:
    """Routes PostgreSQL notifications to asyncio events, by payload (job id) or channel."""

    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self._waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self._feeds: defaultdict[str, set[OutputFeed]] = defaultdict(set)
        self._callbacks: defaultdict[str, list[Callable[[], None]]] = defaultdict(list)
        self.connected = asyncio.Event()
        self.closing = False

    def subscribe(self, key: str) -> asyncio.Event:
        """An event set on every notification for ``key`` (a job id or a channel name)."""
        event = asyncio.Event()
        self._waiters[key].add(event)
        return event

    def unsubscribe(self, key: str, event: asyncio.Event) -> None:
        waiters = self._waiters.get(key)
        if waiters is not None:
            waiters.discard(event)
            if not waiters:
                del self._waiters[key]

    def follow_output(self, job_id: str, wake: asyncio.Event) -> OutputFeed:
        """A feed of the job's streamed chunks as they are announced, setting ``wake``."""
        feed = OutputFeed(wake)
        self._feeds[job_id].add(feed)
        return feed

    def unfollow_output(self, job_id: str, feed: OutputFeed) -> None:
        feeds = self._feeds.get(job_id)
        if feeds is not None:
            feeds.discard(feed)
            if not feeds:
                del self._feeds[job_id]

    def on(self, channel: str, callback: Callable[[], None]) -> None:
        self._callbacks[channel].append(callback)

    def close_streams(self) -> None:
        """Wake every waiter for the last time: the process is shutting down."""
        self.closing = True
        for feeds in self._feeds.values():
            for feed in feeds:
                feed.wake.set()
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()

    def _wake(self, key: str) -> None:
        for feed in self._feeds.get(key, ()):
            feed.events = True
        for event in self._waiters.get(key, ()):
            event.set()

    def _wake_all(self) -> None:
        for feeds in self._feeds.values():
            for feed in feeds:
                feed.gap = True  # chunks may have come while nobody listened
                feed.events = True
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()
        for callbacks in self._callbacks.values():
            for cb in callbacks:
                cb()

    def _output(self, payload: str) -> None:
        if not self._feeds:
            return
        for chunk in parse_payload(payload, self._feeds):
            for feed in self._feeds.get(str(chunk.job_id), ()):
                feed.push(chunk)

    async def run(self) -> None:
        """LISTEN until cancelled: the API runs this as a side task (calmq.supervision)."""
        reconnect = Reconnect("the LISTEN connection was lost")
        while True:
            try:
                async with await listen_connection(self._url) as conn:
                    for channel in (JOB_EVENTS, WEBHOOKS, KEYS, OUTPUT):
                        await conn.execute(f"LISTEN {channel}")
                    self.connected.set()
                    # Anything sent while we were not listening is lost: wake everyone once.
                    self._wake_all()
                    reconnect.succeeded()
                    async for note in conn.notifies():
                        if note.channel == OUTPUT:
                            self._output(note.payload)
                        elif note.channel == JOB_EVENTS:
                            for job_id in note.payload.split(","):
                                self._wake(job_id)
                        else:
                            self._wake(note.channel)
                            for cb in self._callbacks.get(note.channel, ()):
                                cb()
            except asyncio.CancelledError:
                raise
            except psycopg.Error as exc:
                self.connected.clear()
                self._wake_all()
                # Jittered: every API replica lost it at once when the database restarted.
                await asyncio.sleep(reconnect.failed(exc))  # an outage's pause, not a sync
