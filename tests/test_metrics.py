"""A scrape never waits for the kernel: the per-backend counters are read and rendered by a
thread of their own (metrics.CachedCounters), the scrape answers with what is there."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from agent import memory
from agent.core.model import Backend, Identity

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


def _value(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float | None:
    return metrics.registry.get_sample_value(name, labels or {})


def test_ready_and_healthy_are_what_readyz_and_healthz_answer_at_the_scrape() -> None:
    now = [0.0]
    health, metrics = Health(60, 30, clock=lambda: now[0]), Metrics()
    metrics.follow(health)
    assert (_value(metrics, "natgw_ready"), _value(metrics, "natgw_healthy")) == (0.0, 1.0)
    health.synced()
    assert _value(metrics, "natgw_ready") == 1.0
    health.pending()
    now[0] = 61.0  # a change waited longer than stale_after
    assert (_value(metrics, "natgw_ready"), _value(metrics, "natgw_healthy")) == (1.0, 0.0)


def test_cleanup_failures_are_counted_by_kind_from_zero() -> None:
    from agent.run.cleanup import Cleanup

    class Broken:
        def flows(self, query: object) -> list[object]:
            raise OSError("conntrack: dump interrupted")

    metrics = Metrics()
    assert _value(metrics, "natgw_cleanup_failures_total", {"kind": "affinity"}) == 0.0
    cleanup = Cleanup(lambda i: None, lambda: Broken(), lambda: None)  # type: ignore[arg-type,return-value]
    cleanup.failed = metrics.cleanup_failed
    cleanup.note([], [Identity("172.18.0.10", 53, "udp")], {})
    cleanup.run_once()
    assert _value(metrics, "natgw_cleanup_failures_total", {"kind": "conntrack"}) == 1.0
    assert _value(metrics, "natgw_cleanup_failures_total", {"kind": "affinity"}) == 0.0


def test_the_memory_limit_is_the_cgroups_memory_max_or_infinite(tmp_path: Path) -> None:
    own = tmp_path / "cgroup"
    own.write_text("0::/kubepods/pod1/agent\n")
    group = tmp_path / "fs" / "kubepods" / "pod1" / "agent"
    group.mkdir(parents=True)
    (group / "memory.max").write_text("268435456\n")
    assert memory.limit(tmp_path / "fs", own) == 268435456.0
    (group / "memory.max").write_text("max\n")
    assert memory.limit(tmp_path / "fs", own) == float("inf")
    own.write_text("4:memory:/x\n")  # cgroup v1 only
    assert memory.limit(tmp_path / "fs", own) == float("inf")
    assert Metrics().registry.get_sample_value("process_resident_memory_bytes", {}) is not None


def test_the_table_digest_depends_on_what_serves_each_identity_not_on_order_or_history() -> None:
    from agent.core.desired import ListCatalog
    from agent.core.health import DEFAULT, target
    from agent.core.model import manifest
    from agent.kernel.caps import UNPROBED
    from agent.run.planner import Planner
    from agent.settings import Settings
    from tests.builders import web_objects

    docs = web_objects()
    catalog = ListCatalog([m for d in docs if (m := manifest(d)) is not None])
    backwards = ListCatalog([m for d in reversed(docs) if (m := manifest(d)) is not None])
    one, other = Planner(Settings(gateway="gw1"), UNPROBED), Planner(Settings(gateway="gw1"), UNPROBED)
    full = one.whole(catalog, None)
    other.whole(backwards, None)
    assert one.digest == other.digest and 0 < one.digest < 2 ** 52
    # A backend down on one replica only: the digests differ; once it is back, they agree.
    down = target(Backend("10.0.1.12", 8080), DEFAULT)
    one.commit(full)
    one.set_down(frozenset({down}))
    one.partial(catalog, [], full.wanted)
    assert one.digest != other.digest
    other.set_down(frozenset({down}))
    other.whole(backwards, None)  # a whole sync of the same says the same as a partial one
    assert one.digest == other.digest
    one.set_down(frozenset())
    one.partial(catalog, [], full.wanted)
    fresh = Planner(Settings(gateway="gw1"), UNPROBED)
    fresh.whole(catalog, None)
    assert one.digest == fresh.digest
