"""Where a webhook may connect: the address check (translated IPv6 judged by its IPv4),
the pinned resolver the dispatcher connects through, and the bounded read of an answer.

The resolver cases drive the dispatcher's real HTTP side (``Sender``) against real local
servers; only the DNS answer is replaced, by a resolver implementing aiohttp's interface
and handed over the way the dispatcher gets its own.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from aiohttp.abc import AbstractResolver, ResolveResult

from calmq.errors import ContractError
from calmq.producers.webhooks import (
    ANSWER_READ_BYTES,
    PinnedResolver,
    Sender,
    check_callback_url,
    forbidden_address,
)
from calmq.settings import Settings


@pytest.mark.parametrize(("address", "forbidden"), [
    ("64:ff9b::7f00:1", True),         # NAT64 of 127.0.0.1
    ("64:ff9b::a00:1", True),          # NAT64 of 10.0.0.1
    ("64:ff9b::a9fe:a9fe", True),      # NAT64 of 169.254.169.254 (cloud metadata)
    ("64:ff9b::808:808", False),       # NAT64 of 8.8.8.8
    ("64:ff9b:1::7f00:1", True),       # local-use NAT64 (RFC 8215) of 127.0.0.1
    ("2002:7f00:1::", True),           # 6to4 of 127.0.0.1
    ("2002:c0a8:1::1", True),          # 6to4 of 192.168.0.1
    ("2002:808:808::1", False),        # 6to4 of 8.8.8.8
    ("::ffff:127.0.0.1", True),        # IPv4-mapped
    ("::ffff:10.1.2.3", True),
    ("::ffff:8.8.8.8", False),
    ("::127.0.0.1", True),             # IPv4-compatible (deprecated form)
    ("::1", True),
    ("fe80::1%eth0", True),
    ("fd00::1", True),
    ("2606:4700:4700::1111", False),
    ("127.0.0.1", True),
    ("100.64.0.1", True),
    ("224.0.0.1", True),
    ("93.184.216.34", False),
    ("not-an-address", True),
])
def test_translated_ipv6_is_judged_by_the_ipv4_inside(address: str, forbidden: bool) -> None:
    """NAT64, 6to4, mapped and compatible IPv6 addresses are as forbidden as their IPv4."""
    assert forbidden_address(address) is forbidden


@pytest.mark.parametrize("url", ["http://[64:ff9b::7f00:1]/x", "http://[2002:7f00:1::]/x",
                                 "http://[64:ff9b::a9fe:a9fe]/latest"])
def test_translated_literals_are_refused_at_submit(url: str) -> None:
    with pytest.raises(ContractError) as refused:
        asyncio.run(check_callback_url(url, allow_private=False))
    assert refused.value.code == "callback_url_forbidden"


class FixedResolver(AbstractResolver):
    """Answers every name with the given addresses, as a rebinding DNS server would."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = addresses
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        self.asked.append(host)
        return [ResolveResult(hostname=host, host=a, port=port,
                              family=socket.AF_INET6 if ":" in a else socket.AF_INET,
                              proto=0, flags=socket.AI_NUMERICHOST) for a in self.addresses]

    async def close(self) -> None:
        pass


class Server:
    """A local HTTP server counting connections and requests; ``endless`` answers 200 with
    a body that never ends (until the client hangs up)."""

    def __init__(self, *, endless: bool = False) -> None:
        self.requests: list[dict[str, str]] = []
        self.connections = 0
        self.sent = 0
        self.hung_up = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests.append(dict(self.headers))
                if not endless:
                    self.send_response(204)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(10 * 1024 * 1024 * 1024))  # 10 GiB
                self.end_headers()
                chunk = b"x" * 65536
                try:
                    while True:
                        self.wfile.write(chunk)
                        outer.sent += len(chunk)
                except OSError:
                    outer.hung_up.set()

            def log_message(self, *_a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    s.thread.start()
    yield s
    s.server.shutdown()
    s.server.server_close()


def _post(settings: Settings, resolver: AbstractResolver, url: str
          ) -> tuple[int | None, str | None, bool]:
    async def go() -> tuple[int | None, str | None, bool]:
        sender = Sender(settings, resolver)
        try:
            return await sender.post(url, b'{"event":"completed"}',
                                     {"Content-Type": "application/json"})
        finally:
            await sender.close()

    return asyncio.run(go())


def test_a_name_resolving_to_loopback_is_refused_without_a_connection(server: Server) -> None:
    """A callback name the resolver answers with 127.0.0.1 (a rebinding name after it passed
    the submit check) is refused before any connection: the server sees none."""
    resolver = FixedResolver("127.0.0.1", "::ffff:127.0.0.1", "64:ff9b::7f00:1")
    status, error, final = _post(Settings(), resolver,
                                 f"http://rebind.example:{server.port}/hook")
    assert resolver.asked == ["rebind.example"]
    assert (status, final) == (None, True)
    assert error is not None
    assert "private or loopback" in error
    assert server.connections == 0


def test_a_loopback_ip_literal_is_refused_without_a_connection(server: Server) -> None:
    status, _error, final = _post(Settings(), FixedResolver(),
                                  f"http://127.0.0.1:{server.port}/hook")
    assert (status, final) == (None, True)
    assert server.connections == 0


def test_only_allowed_addresses_reach_the_connector() -> None:
    """From a mixed answer the pinned resolver keeps the public addresses only."""
    pinned = PinnedResolver(FixedResolver("10.0.0.1", "93.184.216.34", "64:ff9b::7f00:1"))
    found = asyncio.run(pinned.resolve("mixed.example", 443))
    assert [r["host"] for r in found] == ["93.184.216.34"]


def test_the_name_stays_the_host_header(server: Server) -> None:
    """With private targets allowed the connection goes to the resolved address while the
    request still names the callback's host (Host header; SNI likewise for https)."""
    settings = Settings(webhook_allow_private=True)
    status, error, _final = _post(settings, FixedResolver("127.0.0.1"),
                                  f"http://hooks.example:{server.port}/hook")
    assert (status, error) == (204, None)
    assert server.requests[0]["Host"] == f"hooks.example:{server.port}"


def test_an_endless_answer_is_not_read_whole() -> None:
    """A receiver answering 200 with a 10 GiB body: the delivery succeeds at once, having
    read at most a few KiB, and the connection is dropped (the server sees the hang-up)."""
    big = Server(endless=True)
    big.thread.start()
    try:
        settings = Settings(webhook_allow_private=True, webhook_timeout_seconds=30)
        started = time.monotonic()
        status, error, _final = _post(settings, FixedResolver("127.0.0.1"),
                                      f"http://big.example:{big.port}/hook")
        took = time.monotonic() - started
        assert (status, error) == (200, None)
        assert took < 5, took  # reading 10 GiB (or to the 30 s timeout) would take far longer
        assert big.hung_up.wait(10)  # the server thread saw the hang-up
        assert big.sent < 64 * 1024 * 1024
        assert ANSWER_READ_BYTES <= 16 * 1024
    finally:
        big.server.shutdown()
        big.server.server_close()


def test_a_connect_that_is_never_answered_ends_at_the_connect_timeout() -> None:
    """A receiver whose connect is dropped (its accept queue full, as a blackholed address
    behaves): the attempt fails after webhook_connect_timeout_seconds, not the whole
    webhook_timeout_seconds."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = socket.create_connection(("127.0.0.1", port), timeout=5)  # fills the queue
    try:
        settings = Settings(webhook_allow_private=True, webhook_timeout_seconds=60,
                            webhook_connect_timeout_seconds=0.5)
        started = time.monotonic()
        status, error, final = _post(settings, FixedResolver("127.0.0.1"),
                                     f"http://dead.example:{port}/hook")
        took = time.monotonic() - started
        assert status is None
        assert error is not None
        assert not final  # retried later, with backoff
        assert took < 10, took
    finally:
        filler.close()
        listener.close()
