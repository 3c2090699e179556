"""Waiting on a condition with a deadline: how every test synchronises, never by sleeping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["wait_for", "wait_for_async"]


def wait_for(check: Callable[[], Any], *, timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(delay)  # polling interval of a wait with a deadline, not a synchronisation
        delay = min(delay * 1.5, 0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last value: {last!r}")


async def wait_for_async(check: Callable[[], Awaitable[Any]], *, within: float = 30.0,
                         what: str = "condition") -> Any:
    """``wait_for`` for a check that is a coroutine function, without blocking the loop
    (``within``: the deadline in seconds)."""
    deadline = time.monotonic() + within
    delay = 0.01
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(delay)  # polling interval of a wait with a deadline
        delay = min(delay * 1.5, 0.2)
    raise AssertionError(f"timed out after {within} s waiting for {what}; last value: {last!r}")
