"""Faults: a libnftables stand-in that refuses N transactions, stages that raise, and the
loop that must survive all of it, report unhealthy meanwhile, and converge."""
from __future__ import annotations

import random
import threading
import time
from typing import Any

import structlog

from agent.backoff import Backoff
from agent.health import Health
from agent.nft import Nft
from agent.reconcile import Reconciler, run_loop
from agent.settings import Settings
from tests.conftest import eip, rule
from tests.test_incremental import Accepting, Store

FAST = Settings(gateway="gw1", conntrack=False, retry_min=0.02, retry_max=0.1, poll_interval=0.005,
                healthz_stale_after=0.05, drift_interval=1000.0)


class Flaky(Accepting):
    """Refuses the first `failures` transactions the way the kernel does: rc 1, nothing
    applied. Counts the read-backs too."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.reads = 0

    def json_cmd(self, doc: dict[str, Any]) -> tuple[int, Any, str]:
        if any("list" in c for c in doc["nftables"]):
            self.reads += 1
        elif self.failures > 0:
            self.failures -= 1
            return 1, "", "Error: Could not process rule: injected fault"
        return super().json_cmd(doc)


class StoreSource(Store):
    """The test Store as a reconcile-loop source; `poll_errors` make poll() raise."""

    ready = True

    def __init__(self, poll_errors: int = 0) -> None:
        super().__init__()
        self.poll_errors = poll_errors
        self.first = True

    def poll(self) -> bool:
        if self.poll_errors:
            self.poll_errors -= 1
            raise RuntimeError("injected source fault")
        return bool(self.changes)

    def take_changes(self) -> set[tuple[str, str]] | None:
        changes = self.take()
        if self.first:
            self.first = False
            return None
        return changes

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def world() -> StoreSource:
    source = StoreSource()
    source.put(eip("eip-web", "172.18.0.10"))
    for n in range(3):
        source.put(rule(f"web-{n}", 80, f"10.0.1.{11 + n}"))
    return source


def run(source: StoreSource, reconciler: Reconciler, health: Health, until: Any, timeout: float = 10.0) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=run_loop, args=(FAST, source, reconciler, stop, health), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not until():
            assert thread.is_alive(), "the loop died"
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.002)
    finally:
        stop.set()
        thread.join(5)


def converged(reconciler: Reconciler) -> bool:
    return reconciler.mirror is not None and len(reconciler.mirror.elements["services"]) == 1


def test_refused_transactions_are_retried_with_a_read_back_until_they_land() -> None:
    backend = Flaky(failures=4)
    reconciler = Reconciler(FAST, Nft("ip", "natgw", backend))
    health = Health(FAST.healthz_stale_after, FAST.livez_wedged_after)
    seen_unhealthy = []
    with structlog.testing.capture_logs() as logs:
        run(world(), reconciler, health,
            until=lambda: (seen_unhealthy.append(not health.healthz()[0]) or True) and converged(reconciler))
    failures = [e for e in logs if e["event"].startswith("apply failed")]
    assert len(failures) == 4  # each refusal logged, typed, with the batch's digest
    assert all(e["rc"] == 1 and len(e["digest"]) == 12 and "injected" in e["error"] for e in failures)
    assert len({e["digest"] for e in failures}) == 1  # the same batch each time: nothing half-applied
    assert backend.reads >= 5  # a read-back before every retry, not a blind resend
    assert any(seen_unhealthy)  # /healthz said so while it could not converge ...
    assert health.healthz()[0] and health.readyz()[0]  # ... and recovered with the kernel
    assert health.last_error is None


def test_the_loop_survives_exceptions_from_any_stage() -> None:
    source = world()
    source.poll_errors = 3
    reconciler = Reconciler(FAST, Nft("ip", "natgw", Accepting()))
    original = reconciler.sync
    calls = {"n": 0}

    def sync_failing_once(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("injected pipeline fault")
        return original(*args)

    reconciler.sync = sync_failing_once  # type: ignore[method-assign]
    health = Health(FAST.healthz_stale_after, FAST.livez_wedged_after)
    with structlog.testing.capture_logs() as logs:
        run(source, reconciler, health, until=lambda: converged(reconciler))
    events = [e["event"] for e in logs]
    assert events.count("source poll failed") == 3
    assert "sync failed; will read back and retry" in events
    assert calls["n"] >= 2


def test_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    backoff = Backoff(0.5, 30.0, jitter=0.5, rng=random.Random(7))
    delays = [backoff.next() for _ in range(10)]
    bases = [0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30]
    assert all(base * 0.5 <= d <= base for d, base in zip(delays, bases)), delays
    backoff.reset()
    assert 0.25 <= backoff.next() <= 0.5


def test_health_endpoints_transitions() -> None:
    now = [100.0]
    health = Health(stale_after=60, wedged_after=30, clock=lambda: now[0])
    assert health.readyz() == (False, {"status": "not ready", "reason": "no full sync yet"})
    health.pending()
    now[0] += 61
    ok, body = health.healthz()
    assert not ok and "waited 61.0s" in body["reason"]
    health.synced()
    assert health.healthz()[0] and health.readyz()[0]
    health.beat()
    now[0] += 31
    ok, body = health.livez()
    assert not ok and body["status"] == "wedged"
    health.beat()
    assert health.livez()[0]


def test_systemd_notify_ready_after_first_sync_and_watchdog(tmp_path) -> None:
    import socket

    from agent.sdnotify import Notifier

    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(2)
        notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
        health = Health(60, 30, notifier=notifier)
        health.beat()
        assert sock.recv(100) == b"WATCHDOG=1"
        health.beat()  # within half the watchdog period: not sent again
        health.synced()
        assert sock.recv(100) == b"READY=1\nSTATUS=programmed"
        health.synced()  # only once
        sock.settimeout(0.2)
        try:
            extra = sock.recv(100)
        except socket.timeout:
            extra = b""
        assert extra == b""
