"""The bounded HTTP server: how many requests it holds at once, and for how long."""
from __future__ import annotations

import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any, Iterator

import pytest

from agent.ops.httpserve import BoundedServer, respond


class Held(BaseHTTPRequestHandler):
    """Answers once `release` is set; counts the requests it holds at once."""
    release = threading.Event()
    lock = threading.Lock()
    active = 0
    most = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        cls = type(self)
        with cls.lock:
            cls.active += 1
            cls.most = max(cls.most, cls.active)
        try:
            cls.release.wait(10)
            respond(self, 200, "text/plain", b"ok")
        finally:
            with cls.lock:
                cls.active -= 1

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def held() -> Iterator[type[Held]]:
    handler = type("HeldHere", (Held,), {"release": threading.Event(), "lock": threading.Lock()})
    yield handler
    handler.release.set()


def serve(handler: type[BaseHTTPRequestHandler], limit: int, timeout: float) -> BoundedServer:
    return BoundedServer(("127.0.0.1", 0), handler, limit=limit, timeout=timeout).start("test-http")


def ask(server: BoundedServer, path: str = "/") -> socket.socket:
    sock = socket.create_connection(server.server_address[:2], timeout=10)
    sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
    return sock


def answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (b"" when it closed at once)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass  # closed with our request unread: refused
    sock.close()
    return data


def wait(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_at_most_four_requests_at_once_and_a_fifth_is_refused_not_queued(held: type[Held]) -> None:
    server = serve(held, limit=4, timeout=5.0)
    try:
        four = [ask(server) for _ in range(4)]
        wait(lambda: held.active == 4)
        started = time.monotonic()
        assert answer(ask(server)) == b""  # the fifth: closed unanswered ...
        assert time.monotonic() - started < 1.0  # ... at once, not after a slot frees
        held.release.set()
        assert all(answer(s).startswith(b"HTTP/1.0 200") for s in four)
        assert held.most == 4
        assert answer(ask(server)).startswith(b"HTTP/1.0 200")  # the slots are free again
    finally:
        server.shutdown()
        server.server_close()


def test_a_slow_client_is_cut_off_after_the_request_bound_however_it_trickles(held: type[Held]) -> None:
    held.release.set()
    server = serve(held, limit=1, timeout=0.5)
    try:
        slow = socket.create_connection(server.server_address[:2], timeout=10)
        slow.sendall(b"GET / HTTP/1.0\r\n")
        started, closed_after = time.monotonic(), None
        while time.monotonic() - started < 8.0:
            try:
                slow.sendall(b"X-Slow: 1\r\n")  # a header every 0.1 s: each read well inside 0.5 s
            except OSError:
                closed_after = time.monotonic() - started
                break
            if select.select([slow], [], [], 0.1)[0]:
                try:
                    assert slow.recv(65536) == b""  # shut, unanswered
                except ConnectionResetError:
                    pass
                closed_after = time.monotonic() - started
                break
            if time.monotonic() - started < 0.3:  # while it trickles, its slot is taken
                assert answer(ask(server)) == b""
        slow.close()
        # Cut at the 0.5 s bound (a busy machine may take a while to say so), never before it.
        assert closed_after is not None and 0.3 < closed_after < 6.0, closed_after
        # ... and its slot is free again, once its thread has seen the cut (the client may
        # see the shut socket first: asked at once, the server can still refuse).
        wait(lambda: answer(ask(server)).startswith(b"HTTP/1.0 200"))
    finally:
        server.shutdown()
        server.server_close()


def test_shutdown_needs_no_connection_to_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    # In a network namespace whose lo is down nothing reaches 127.0.0.1: the stop must not
    # depend on a connection (it once did, and an idle agent ignored SIGTERM for an hour).
    def unreachable(*args: Any, **kwargs: Any) -> socket.socket:
        raise OSError("network unreachable")

    server = BoundedServer(("127.0.0.1", 0), BaseHTTPRequestHandler).start("test")
    monkeypatch.setattr(socket, "create_connection", unreachable)
    stopper = threading.Thread(target=server.shutdown, daemon=True)
    stopper.start()
    stopper.join(10)
    assert not stopper.is_alive(), "shutdown still waiting for serve_forever"
    server.server_close()
