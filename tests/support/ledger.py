"""A real HTTP ledger for the invoice workflow tests: postings keyed by Idempotency-Key.

The same key answers the first posting again (200) instead of booking a second one, which
is what "record then call then confirm" relies on. ``hold`` makes the next posting wait
until ``release``: with ``book_first`` the posting is booked before the wait (the crash falls
between the call and its confirmation), without it the request is dropped (the crash falls
before the posting landed).
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Ledger:
    def __init__(self) -> None:
        self.postings: dict[str, dict[str, Any]] = {}  # key -> posting
        self.requests: list[str] = []  # the key of every request, in arrival order
        self.lock = threading.Lock()
        self._hold: tuple[threading.Event, bool] | None = None
        self.held = threading.Event()
        ledger = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def do_POST(self) -> None:
                key = self.headers.get("Idempotency-Key", "")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with ledger.lock:
                    ledger.requests.append(key)
                    hold, ledger._hold = ledger._hold, None
                if hold is not None:
                    release, book_first = hold
                    if book_first:
                        ledger.book(key, body)
                    ledger.held.set()
                    release.wait(60)
                    self.close_connection = True
                    return  # the caller is gone by now; it never hears an answer
                existing = ledger.postings.get(key)
                posting = existing or ledger.book(key, body)
                data = json.dumps(posting).encode()
                self.send_response(200 if existing else 201)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/postings"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._release = threading.Event()

    def book(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            if key not in self.postings:
                self.postings[key] = {"posting_id": str(uuid.uuid4()), "key": key, **body}
            return self.postings[key]

    def hold(self, *, book_first: bool) -> None:
        self._release = threading.Event()
        self.held.clear()
        self._hold = (self._release, book_first)

    def release(self) -> None:
        self._release.set()

    def for_job(self, job_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [p for p in self.postings.values() if p["job_id"] == job_id]

    def requests_for(self, job_id: str) -> list[str]:
        with self.lock:
            return [k for k in self.requests if k.startswith(job_id)]

    def start(self) -> Ledger:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()
