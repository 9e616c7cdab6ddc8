"""A scrape never waits for the kernel: the per-backend counters are read and rendered by a
thread of their own (metrics.CachedCounters), the scrape answers with what is there."""
from __future__ import annotations

import socket
import threading
import time

from agent.ops.health import Health, serve
from agent.ops.metrics import Counters, Metrics

BACKEND = ("172.18.0.10:80/tcp", "10.0.1.11:8080")


def scrape(address: tuple[str, int]) -> tuple[float, str]:
    """(seconds it took, the body) of GET /metrics."""
    started = time.monotonic()
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.0 200"), head
    return time.monotonic() - started, body


def test_a_scrape_answers_at_once_while_the_kernel_read_blocks() -> None:
    kernel_answers = threading.Event()
    readers: list[str] = []

    def read() -> Counters:  # a kernel dump that takes as long as the test says
        readers.append(threading.current_thread().name)
        kernel_answers.wait(10)
        return {BACKEND: (7, 420)}

    metrics = Metrics()
    metrics.serve_backend_counters(read, interval=0.0)
    server = serve(Health(60, 30), "127.0.0.1:0", metrics)
    try:
        address = server.server_address[:2]
        for _ in range(5):  # more scrapes than request slots: none of them is held by the read
            took, body = scrape(address)
            assert took < 0.5 and "natgw_sync_failures_total" in body
            assert "natgw_backend_packets" not in body  # nothing read yet
        assert readers == ["counters"]  # one read, in the background, still blocked
        kernel_answers.set()
        deadline = time.monotonic() + 5
        while 'natgw_backend_packets_total{backend="10.0.1.11:8080",identity="172.18.0.10:80/tcp"} 7.0' not in body:
            assert time.monotonic() < deadline, "the background reading never showed"
            time.sleep(0.02)
            body = scrape(address)[1]
        assert set(readers) == {"counters"}  # never on a request's thread
    finally:
        kernel_answers.set()
        server.shutdown()
        server.server_close()
