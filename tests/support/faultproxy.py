"""A TCP proxy between two real parts that a test can cut and restore.

``cut()`` closes every open connection and refuses new ones (as a network partition or a
restarting server would look to the client); ``restore()`` lets connections through again.
Threads and plain sockets, so it runs beside any process under test.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType

__all__ = ["FaultProxy"]


class FaultProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *_exc: type[BaseException] | BaseException | TracebackType | None
                 ) -> None:
        self.close()

    def cut(self) -> None:
        """Drop every connection now, and refuse new ones until ``restore``."""
        self._open.clear()
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def restore(self) -> None:
        self._open.set()

    def retarget(self, host: str, port: int) -> None:
        """Send new connections to ``host:port`` and drop the open ones: the same address
        now reaches another server, as a cloud database's endpoint does after a failover."""
        self.target = (host, port)
        self.cut()
        self.restore()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _addr = self._listener.accept()
            except OSError:
                return
            if not self._open.is_set():
                client.close()  # refused: the client sees the connection end at once
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
