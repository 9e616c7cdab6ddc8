"""The fake's listening socket, with outages on demand."""
from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any


class Listener:
    """Accepts connections on one socket, serving each on its own thread. ``down()`` stops
    listening (connects are refused) and cuts open connections; ``up()`` listens again on
    the same port. ``tls``: each connection is served over TLS with this server context."""

    def __init__(self, sock: socket.socket | None, serve: Callable[[socket.socket, Any], object],
                 tls: ssl.SSLContext | None = None) -> None:
        self.sock = sock if sock is not None else _bind_loopback()
        self.tls = tls
        self.port: int = self.sock.getsockname()[1]
        self._serve = serve
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._up = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"fakekube:{self.port}", daemon=True)

    def start(self) -> None:
        self.sock.listen(128)
        self.sock.settimeout(0.5)
        self._up.set()
        self._thread.start()

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.down()
        self._up.set()  # release the accept loop to see it is stopping
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.sock.close()

    def down(self) -> None:
        if self._up.is_set():
            self._up.clear()
            self.sock.shutdown(socket.SHUT_RDWR)  # Linux stops listening; a blocked accept() returns
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its thread

    def up(self) -> None:
        if self._up.is_set():
            return
        self.sock.listen(128)
        if self.sock.getsockname()[1] != self.port:
            raise RuntimeError(f"the listening socket came back on port {self.sock.getsockname()[1]}, not "
                               f"{self.port}: bind a caller's socket to an explicit port to use set_down()")
        self._up.set()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            if not self._up.wait(0.5):
                continue
            try:
                conn, addr = self.sock.accept()
            except OSError:  # a timeout, or shut down under us by down() or stop()
                continue
            conn.setblocking(True)
            with self._lock:  # tracked before anything else, so down() cannot miss it
                self._conns.add(conn)
            if not self._up.is_set():  # went down meanwhile
                self._untrack(conn)
                continue
            threading.Thread(target=self._run, args=(conn, addr), daemon=True).start()

    def _run(self, conn: socket.socket, addr: Any) -> None:
        try:
            if self.tls is not None:  # the handshake on this thread: a slow client holds up no other
                conn = self._wrap(conn)
            self._serve(conn, addr)
        except OSError:
            pass  # cut by down()/stop()/break_watches() or by the client: expected
        finally:
            self._untrack(conn)

    def _wrap(self, conn: socket.socket) -> socket.socket:
        """The TLS socket in place of the plain one (which wrapping detaches), tracked
        before its handshake so that down() can cut it."""
        assert self.tls is not None
        with self._lock:
            self._conns.discard(conn)
            wrapped = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            self._conns.add(wrapped)
        wrapped.do_handshake()
        return wrapped

    def _untrack(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)
        conn.close()


def _bind_loopback() -> socket.socket:
    # An explicit port (found by binding port 0) rather than port 0 itself: Linux gives back an
    # auto-assigned port when a listener is shut down, and down()/up() need it to stay.
    last: OSError | None = None
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            return sock
        except OSError as exc:  # raced with someone else for that port: probe again
            sock.close()
            last = exc
    raise OSError(f"could not bind a loopback port: {last}")
