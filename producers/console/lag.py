"""The overview's consumer lag: the kernel's reader (calmq.lag), cached for page views.

The overview shows the fleet's view: for every calmq consumer group the messages of each
topic it has not committed yet, read by ``calmq.lag.LagReader.read_fleet`` (no group
membership, none of the admin client's group requests, fresh clients after a failure).
Its calls block on broker round trips, so a read runs in a thread, at most one at a time,
and its answer is kept for ``ttl`` seconds: page views share it and never block the event
loop. A broker that does not answer in time gives ``None`` ("lag unavailable" on the
page), never an error page.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from calmq.lag import GroupLag, LagReader, per_group_topic

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = ["FleetLag", "GroupLag"]

log = logging.getLogger(__name__)


class FleetLag:
    def __init__(self, *, ttl: float = 5.0, timeout: float = 3.0) -> None:
        self.ttl = ttl
        self.timeout = timeout
        self._reader: LagReader | None = None
        self._settings: Settings | None = None
        self._value: list[GroupLag] | None = None
        self._at = -float("inf")
        self._lock = asyncio.Lock()

    async def read(self, settings: Settings) -> list[GroupLag] | None:
        """The lag per group and topic (at most ``ttl`` seconds old), None: unavailable."""
        if time.monotonic() - self._at < self.ttl:
            return self._value
        async with self._lock:
            if time.monotonic() - self._at < self.ttl:  # read while this one waited
                return self._value
            try:
                if self._reader is None or settings is not self._settings:
                    from calmq.kafka import connection_config

                    # The process's Kafka settings (security, pass-through), as every
                    # client of it has.
                    self._reader = LagReader(connection_config(settings),
                                             timeout=self.timeout)
                    self._settings = settings
                # The broker calls carry their own timeouts; this bounds the whole read.
                rows = await asyncio.wait_for(asyncio.to_thread(self._reader.read_fleet),
                                              self.timeout * 4)
                value: list[GroupLag] | None = per_group_topic(rows)
            except Exception as exc:  # noqa: BLE001 - any broker failure: "unavailable"
                log.warning("reading consumer lag failed: %s", exc)
                value = None
            self._value, self._at = value, time.monotonic()
        return value
