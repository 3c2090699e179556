"""One LISTEN connection per API process, fanned out to whoever waits on a channel or a job.

The job_events trigger (migration 0004) sends ``NOTIFY calmq_job_events, '<id>,<id>,...'``
(the jobs that got an event in one statement);
SSE streams wait on their job's id here instead of polling the table. Other channels
(``calmq_webhooks``, ``calmq_api_keys``) wake a waiter keyed by the channel name.
If the connection drops, every waiter is woken (so streams re-read the table) and the hub
reconnects with a short backoff.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

import psycopg

from calmq.retrying import Reconnect

__all__ = ["JOB_EVENTS", "KEYS", "WEBHOOKS", "Hub"]

JOB_EVENTS = "calmq_job_events"
WEBHOOKS = "calmq_webhooks"
KEYS = "calmq_api_keys"


class Hub:
    """Routes PostgreSQL notifications to asyncio events, by payload (job id) or channel."""

    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self._waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
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

    def on(self, channel: str, callback: Callable[[], None]) -> None:
        self._callbacks[channel].append(callback)

    def close_streams(self) -> None:
        """Wake every waiter for the last time: the process is shutting down."""
        self.closing = True
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()

    def _wake(self, key: str) -> None:
        for event in self._waiters.get(key, ()):
            event.set()

    def _wake_all(self) -> None:
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()
        for callbacks in self._callbacks.values():
            for cb in callbacks:
                cb()

    async def run(self) -> None:
        """LISTEN until cancelled: the API runs this as a side task (calmq.supervision)."""
        reconnect = Reconnect("the LISTEN connection was lost")
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._url, autocommit=True
                ) as conn:
                    for channel in (JOB_EVENTS, WEBHOOKS, KEYS):
                        await conn.execute(f"LISTEN {channel}")
                    self.connected.set()
                    # Anything sent while we were not listening is lost: wake everyone once.
                    self._wake_all()
                    reconnect.succeeded()
                    async for note in conn.notifies():
                        if note.channel == JOB_EVENTS:
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
