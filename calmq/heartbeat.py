"""Liveness that an event loop proves by turning: the metrics port's ``/livez``.

The parts without an HTTP API (worker, batcher, forwarder, reaper, relay) serve /metrics
from a thread of their own, and their liveness probe used to read it: a wedged event loop
(a blocking call, a deadlock) still answered, so the kubelet never restarted the pod while
it held its partitions and did no work. A ``Heartbeat`` is a timestamp the loop writes
every second (``beat``, a task on that loop); ``/livez`` on the metrics port answers 200
while it is fresh and 503 once it is ``stale_after`` seconds old. A process that registers
no heartbeat (the relay's own thread loop) answers 200 while it runs, as before.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

__all__ = ["STALE_AFTER", "Heartbeat", "serve_metrics", "with_heartbeat"]

# Well above a busy loop's longest honest pause (a large batch decoded, a GC of a big heap,
# measured under a second) and well below what a probe needs to notice: three failures of
# a 10 s probe restart the pod about 60 s after its loop stopped.
STALE_AFTER = 30.0


class Heartbeat:
    """The last moment the loop turned (``time.monotonic``), written by ``beat``."""

    def __init__(self, stale_after: float = STALE_AFTER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after = stale_after
        self._clock = clock
        self.last = clock()

    async def beat(self, every: float = 1.0) -> None:
        """Write the time every ``every`` seconds, until cancelled."""
        while True:
            self.last = self._clock()
            await asyncio.sleep(every)

    def age(self) -> float:
        return self._clock() - self.last

    def fresh(self) -> bool:
        return self.age() < self.stale_after


async def with_heartbeat(main: Coroutine[Any, Any, Any], heartbeat: Heartbeat,
                         every: float = 1.0) -> Any:
    """Run ``main`` with ``heartbeat`` beating on the same loop."""
    beating = asyncio.create_task(heartbeat.beat(every), name="heartbeat")
    try:
        return await main
    finally:
        beating.cancel()


def _app(heartbeat: Heartbeat | None) -> Callable[..., Iterable[bytes]]:
    from prometheus_client import make_wsgi_app

    metrics = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/livez":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        if heartbeat is None or heartbeat.fresh():
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"live\n"]
        age = f"the event loop has not turned for {heartbeat.age():.0f} s\n"
        start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
        return [age.encode()]

    return app


def serve_metrics(port: int, host: str, heartbeat: Heartbeat | None = None
                  ) -> tuple[Any, threading.Thread]:
    """/metrics (and /livez) on ``host:port`` from a daemon thread, as prometheus_client's
    start_http_server serves /metrics; returns the server (``shutdown()`` stops it)."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    class Server(ThreadingWSGIServer):
        # An IPv6 literal (metrics_host "::") needs its own address family.
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass  # a scrape or a probe every few seconds is not news

    httpd = make_server(host, port, _app(heartbeat), Server, handler_class=Quiet)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
    thread.start()
    return httpd, thread
