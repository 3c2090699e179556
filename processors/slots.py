"""Call slots: how many claimed attempts may be in their step (the model calls) at once.

The consumer keeps a few more jobs claimed than there are slots, so when a call ends the
next one starts at once instead of after a poll, a claim and a request: with every slot
waiting on its own round trip, calls that started together kept ending together, and a
1,000-slot worker spent a third of each 2 s cycle between waves (bench ``slow``).
Interactive attempts get a slot first, and may use a reserve beyond the bound, as the
consumer lets interactive work exceed its bound (processors/consumer.py).
"""

from __future__ import annotations

import asyncio
from collections import deque

from calmq.jobs import Priority

__all__ = ["CallSlots", "queue_room"]


class CallSlots:
    def __init__(self, size: int, reserve: int = 0) -> None:
        if size < 1:
            raise ValueError("at least one call slot is needed")
        self.size = size
        self.reserve = reserve
        self.used = 0
        self._waiting: dict[bool, deque[asyncio.Future[None]]] = {True: deque(), False: deque()}

    def _limit(self, interactive: bool) -> int:
        return self.size + self.reserve if interactive else self.size

    async def acquire(self, priority: str) -> None:
        interactive = priority == Priority.INTERACTIVE
        # Nobody jumps the queue of its own priority, and bulk never passes interactive.
        ahead = self._waiting[True] or (not interactive and self._waiting[False])
        if self.used < self._limit(interactive) and not ahead:
            self.used += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[interactive].append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # granted just as it was cancelled: hand the slot on
            elif future in self._waiting[interactive]:
                self._waiting[interactive].remove(future)
            raise

    def release(self) -> None:
        self.used -= 1
        for interactive in (True, False):
            queue = self._waiting[interactive]
            while queue and self.used < self._limit(interactive):
                future = queue.popleft()
                if not future.done():
                    self.used += 1
                    future.set_result(None)


def queue_room(priority: str, bound: int, reserve: int, *, held: int, interactive: int) -> int:
    """The jobs of a queue a worker may start now (fair share's room): bulk work the
    ``bound`` less every job held; interactive work what bulk leaves of the bound, and the
    ``reserve`` beyond it, less the interactive jobs held. Bulk held past the bound (the
    bound follows the token budget, and shrinks under jobs claimed before) does not eat
    into the reserve."""
    if priority != Priority.INTERACTIVE:
        return bound - held
    return max(bound - (held - interactive), 0) + reserve - interactive
