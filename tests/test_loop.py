"""The loop under faults: a table that refuses N transactions, stages that raise; the loop
must survive all of it, report unhealthy meanwhile, and converge."""
from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import structlog

from agent.ops.health import Health
from agent.run.loop import StopEvent, run_loop
from agent.run.reconcile import Reconciler
from agent.settings import Settings
from tests.builders import eip, rule
from tests.fakenft import FakeNft, edges, wired
from tests.sources import StoreSource

FAST = Settings(gateway="gw1", conntrack=False, retry_min=0.02, retry_max=0.1, poll_interval=0.005,
                healthz_stale_after=0.05)


def world() -> StoreSource:
    source = StoreSource()
    source.put(eip("eip-web", "172.18.0.10"))
    for n in range(3):
        source.put(rule(f"web-{n}", 80, f"10.0.1.{11 + n}"))
    return source


def run(source: StoreSource, reconciler: Reconciler, health: Health, until: Any, timeout: float = 10.0) -> None:
    stop = StopEvent()
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
    backend = FakeNft()
    backend.fail_next(4)
    reconciler = wired(FAST, *edges(backend))
    health = Health(FAST.healthz_stale_after, FAST.livez_wedged_after)
    seen_unhealthy = []
    with structlog.testing.capture_logs() as logs:
        run(world(), reconciler, health,
            until=lambda: (seen_unhealthy.append(not health.healthz()[0]) or True) and converged(reconciler))
    failures = [e for e in logs if e["event"].startswith("apply failed")]
    assert len(failures) == 4  # each refusal logged, typed, with the batch's digest
    assert all(e["rc"] == 1 and len(e["digest"]) == 12 and "injected" in e["error"] for e in failures)
    assert len({e["digest"] for e in failures}) == 1  # the same batch each time: nothing half-applied
    assert reconciler.view.reads >= 5  # a read-back before every retry, not a blind resend
    assert any(seen_unhealthy)  # /healthz said so while it could not converge ...
    assert health.healthz()[0] and health.readyz()[0]  # ... and recovered with the kernel
    assert health.last_error is None


def test_the_loop_survives_exceptions_from_any_stage() -> None:
    source = world()
    source.poll_errors = 3
    reconciler = wired(FAST, *edges(FakeNft()))
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


# ---- sleeping until there is work

IDLE = Settings(gateway="gw1", conntrack=False, idle_wakeup=30.0, resync_interval=3600.0, retire_delay=0.0)


def started(source: Any, settings: Settings = IDLE) -> tuple[Any, threading.Thread, FakeNft]:
    from agent.run.loop import Loop, StopEvent

    backend = FakeNft()
    loop = Loop(settings, source, wired(settings, *edges(backend)), StopEvent())
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    return loop, thread, backend


def wait_until(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_an_idle_loop_sleeps_and_a_change_wakes_it_at_once() -> None:
    from tests.sources import WakingSource

    source = WakingSource()
    source.put(eip("eip-web", "172.18.0.10"))
    loop, thread, backend = started(source)
    try:
        wait_until(lambda: loop.syncs == 1)
        turns = loop.turns
        time.sleep(0.5)
        assert loop.turns - turns <= 2  # asleep: no tick (the next due timer is 30 s away)
        source.put(rule("web-a", 80, "10.0.1.11"))
        wait_until(lambda: loop.syncs == 2)  # woken by the change, not by a timer
        assert backend.view().read().elements["services"]
    finally:
        loop.stop.set()
        thread.join(5)
    assert not thread.is_alive()  # a stop wakes it too


def test_a_burst_of_changes_goes_as_one_transaction() -> None:
    from tests.sources import WakingSource

    source = WakingSource()
    source.put(eip("eip-web", "172.18.0.10"))
    loop, thread, backend = started(source)
    try:
        wait_until(lambda: loop.syncs == 1)
        batches = len(backend.batches)

        def burst() -> None:
            for n in range(10):  # ten watch events in a row, as a controller writes ten rules
                source.put(rule(f"web-{n}", 80, f"10.0.1.{11 + n}"))

        burst()
        wait_until(lambda: loop.syncs >= 2)
        time.sleep(0.05)
        assert loop.syncs == 2 and len(backend.batches) == batches + 1  # one sync, one transaction
        assert len(backend.view().read().elements["services"]) == 1
    finally:
        loop.stop.set()
        thread.join(5)


class NotifyingView:
    """The fake's view with a kernel notification socket's behaviour: a descriptor that
    stays readable until keep_up() or damage() reads what waits (a pipe here)."""

    def __init__(self, view: Any) -> None:
        import os

        self._view = view
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        self.drained = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)

    def fileno(self) -> int:
        return self._read

    def notify(self) -> None:
        import os

        os.write(self._write, b"n")

    def _drain(self) -> None:
        import os

        try:
            while os.read(self._read, 4096):
                self.drained += 1
        except BlockingIOError:
            pass

    def keep_up(self) -> None:
        self._drain()

    def damage(self) -> Any:
        self._drain()
        return self._view.damage()


def test_a_notification_while_a_sync_waits_does_not_make_the_loop_spin() -> None:
    """A notification that arrives while a sync cannot run yet (the source not ready, a
    retry waiting out its backoff) is read at once; its drift check follows the sync."""
    from agent.run.loop import Loop, StopEvent

    source = world()
    source.ready = False  # type: ignore[misc]
    backend = FakeNft()
    nft, view = edges(backend)
    notifying = NotifyingView(view)
    reconciler = wired(IDLE, nft, notifying)  # type: ignore[arg-type]
    loop = Loop(IDLE, source, reconciler, StopEvent())
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        notifying.notify()
        wait_until(lambda: notifying.drained >= 1)
        turns = loop.turns
        time.sleep(0.5)
        # Not ready: polled every poll_interval (0.2 s), never woken by the read socket.
        assert loop.turns - turns <= 4
        assert loop.schedule.drift_due and loop.syncs == 0
        source.ready = True  # type: ignore[misc]
        wait_until(lambda: loop.syncs == 1 and not loop.schedule.drift_due)  # synced, then looked for drift
    finally:
        loop.stop.set()
        thread.join(5)



def test_what_others_did_while_the_view_was_deaf_is_repaired_though_nothing_wakes_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first sync is large (deaf: agent/kernel/view.py); someone flushes one of the agent's
    chains in that window. No notification comes for it, nor anything after: the loop
    still checks for drift, reads back and repairs."""
    from agent.run.loop import Loop, StopEvent

    monkeypatch.setattr("agent.run.reconcile.LARGE_TRANSACTION", 0)  # this one sync is large
    source = world()
    backend = FakeNft()
    nft, view = edges(backend)
    notifying = NotifyingView(view)  # a descriptor to sleep on: no drift check every turn
    agents = backend.json_cmd

    def then_someone_else(doc: Any) -> Any:
        out = agents(doc)
        if "slot_0" in str(doc):
            backend.json_cmd = agents  # type: ignore[method-assign]
            backend.external([{"flush": {"chain": {"family": "ip", "table": "natgw", "name": "slot_0"}}}])
        return out

    backend.json_cmd = then_someone_else  # type: ignore[method-assign]
    loop = Loop(IDLE, source, wired(IDLE, nft, notifying), StopEvent())  # type: ignore[arg-type]
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: loop.syncs == 1)
        wait_until(lambda: backend.view().read().rules.get("slot_0"))  # repaired
        assert view.deaf_windows == 1 and notifying.drained == 0  # no notification woke it
    finally:
        loop.stop.set()
        thread.join(5)

def test_a_change_is_synced_while_the_cleanup_of_an_earlier_one_is_still_running() -> None:
    """Cleanup never holds up a change: with the conntrack pass of a removal stuck, the
    next change is synced anyway, and the pass completes afterwards."""
    from agent.core.flows import Flow, Query
    from agent.run.loop import Loop, StopEvent
    from tests.sources import WakingSource

    release, entered = threading.Event(), threading.Event()
    deleted: list[Flow] = []

    class StuckTable:
        def flows(self, query: Query) -> list[Flow]:
            entered.set()
            release.wait(10)  # a slow dump of a large conntrack table
            return [Flow(6, "172.18.0.100", 40000, query.eip, 80, "10.0.1.11", 8080)]

        def delete(self, flows: Any) -> int:
            deleted.extend(flows)
            return len(flows)

    source = WakingSource()
    source.put(eip("eip-web", "172.18.0.10"))
    source.put(rule("web-a", 80, "10.0.1.11"))
    backend = FakeNft()
    reconciler = wired(IDLE, *edges(backend), flow_table=StuckTable)
    loop = Loop(IDLE, source, reconciler, StopEvent())
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: loop.syncs == 1)
        source.drop("IptablesDnatRule", "web-a")
        source.wake()
        assert entered.wait(5)  # the removal's conntrack pass has begun, and hangs
        source.put(rule("web-b", 81, "10.0.1.12"))
        wait_until(lambda: loop.syncs == 3)  # the next change is in the kernel meanwhile
        assert [k[2] for k in backend.view().read().elements["services"]] == [81]
        assert not deleted
        release.set()
        wait_until(lambda: len(deleted) == 1)  # and the pass completes after
        assert deleted[0].dport == 80
    finally:
        release.set()
        loop.stop.set()
        thread.join(5)


def test_an_idle_loop_sleeps_past_the_wedge_limit_and_is_live_when_asked() -> None:
    """The loop has no heartbeat timer: idle for longer than livez_wedged_after, it is
    still live when a probe asks, because the probe wakes it and sees it turn."""
    from agent.run.loop import Loop, StopEvent
    from tests.sources import WakingSource

    settings = Settings(gateway="gw1", conntrack=False, idle_wakeup=300.0, livez_wedged_after=0.2)
    source = WakingSource()
    source.put(eip("eip-web", "172.18.0.10"))
    health = Health(settings.healthz_stale_after, settings.livez_wedged_after)
    loop = Loop(settings, source, wired(settings, *edges(FakeNft())), StopEvent(), health)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: loop.syncs == 1)
        time.sleep(0.6)
        turns = loop.turns
        assert loop.turns - turns <= 1 and time.monotonic() - health.heartbeat > 0.2  # asleep, silent
        assert health.livez()[0]  # woken by the probe: it turns, so it is live
        assert loop.turns > turns
    finally:
        loop.stop.set()
        thread.join(5)


def test_health_transitions_that_come_together_are_handled_together() -> None:
    """Transitions wait up to HEALTH_BATCH after the last handling, then go in one batch
    (one scan, one sync): 10,000 backends failing over a round of checks came as ~400
    handlings and syncs, one per loop wake."""
    from agent.core.health import DEFAULT, target
    from agent.core.model import Backend
    from agent.run.checks import HealthChecks
    from agent.run.loop import Loop, StopEvent
    from tests.test_checks import _FakeProber

    reconciler = wired(FAST, *edges(FakeNft()))
    checks = HealthChecks(_FakeProber)
    stop = StopEvent()
    loop = Loop(FAST, world(), reconciler, stop, checks=checks)
    thread = threading.Thread(target=loop.run, daemon=True)
    a, b, c = (target(Backend(f"10.0.1.{11 + n}", 8080), DEFAULT) for n in range(3))

    def fail(*targets: Any) -> None:
        for _ in range(DEFAULT.fall):
            for t in targets:
                checks.prober.report(t, False, "connection refused")

    with structlog.testing.capture_logs() as logs:
        thread.start()
        try:
            wait_until(lambda: checks.prober.targets == {a, b, c})
            fail(a)
            wait_until(lambda: reconciler.planner.down == {a})
            fail(b)
            time.sleep(0.05)  # a loop handling each as it came would take b alone
            fail(c)  # both while the batch after a's is not yet due
            wait_until(lambda: reconciler.planner.down == {a, b, c})
        finally:
            stop.set()
            thread.join(5)
    handled = [e["transitions"] for e in logs if e["event"] == "health changed the choice"]
    assert handled == [1, 2]
