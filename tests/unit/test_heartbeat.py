"""Liveness on the metrics port (calmq/heartbeat.py): /livez answers from the event loop's
heartbeat, so a wedged loop fails the probe while the metrics thread still serves."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.error
import urllib.request

from calmq.heartbeat import Heartbeat, serve_metrics, with_heartbeat
from tests.support.waiting import wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return refused.code


def test_livez_fails_while_the_event_loop_is_blocked_and_metrics_still_answer() -> None:
    """A real loop blocked by a synchronous call: /livez turns 503 within its staleness
    bound while /metrics answers 200, and turns 200 again once the loop runs."""
    heartbeat = Heartbeat(stale_after=0.5)
    port = _free_port()
    server, _thread = serve_metrics(port, "127.0.0.1", heartbeat)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    runner = threading.Thread(target=loop.run_until_complete,
                              args=(with_heartbeat(stop.wait(), heartbeat, every=0.05),))
    runner.start()
    release = threading.Event()
    try:
        livez, metrics = f"http://127.0.0.1:{port}/livez", f"http://127.0.0.1:{port}/metrics"
        wait_for(lambda: _status(livez) == 200, timeout=10, what="a live loop")
        # The loop's thread now blocks in a plain synchronous wait, as a wedged call would.
        loop.call_soon_threadsafe(release.wait, 30)
        wait_for(lambda: _status(livez) == 503, timeout=10, what="/livez to fail")
        assert _status(metrics) == 200
        release.set()
        wait_for(lambda: _status(livez) == 200, timeout=10, what="/livez to recover")
    finally:
        release.set()
        loop.call_soon_threadsafe(stop.set)
        runner.join(10)
        loop.close()
        server.shutdown()

