"""Waiting on a condition with a deadline: how every test synchronises, never by sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["wait_for"]


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
