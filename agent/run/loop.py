"""The loop that drives the reconciler: it sleeps until there is work -- a source's
change, a kernel change notification, a timer that is due -- and then does it: sync
(changes arriving together within a few milliseconds go as one), repair drift, retry a
failure after a capped, jittered backoff and a full read-back, resync hourly, retire
emptied chains, delete stale affinity entries a slice at a time (the cleanup thread,
agent/run/cleanup.py, finds them and clears conntrack); and it tells health and metrics.
When each is due is its Schedule's (agent/run/schedule.py); what it calls are protocols
below, which every source and view implements whole, so nothing here probes for members.

Why no fixed tick: a 200 ms tick made a watch event wait 87 ms on median before the sync
(which itself takes ~2 ms), and woke an idle agent five times a second. Now a change is
picked up at once; at rest the loop wakes only for its timers (systemd's watchdog, where
there is one; else every `settings.idle_wakeup` seconds at most). A liveness probe wakes it
to see it turn (Health.livez): a heartbeat timer would cost an idle agent ~25 ms of CPU a
wake-up on this machine."""
from __future__ import annotations

import os
import select
import selectors
import threading
import time
from typing import Any, Callable, Protocol

import structlog

from agent.core.desired import DesiredState, ObjectKey
from agent.errors import ApplyError
from agent.ops.health import Health
from agent.memory import collect_cycles
from agent.ops.metrics import Metrics
from agent.run.checks import HealthChecks
from agent.run.cleanup import Cleanup
from agent.run.reconcile import SyncResult
from agent.run.schedule import Schedule
from agent.settings import Settings

log = structlog.get_logger()
# Transitions said one by one (log line, Events) per turn: a VPC link down fails 40,000
# backends at once, and 40,000 log lines and Events would say nothing the count does not.
SAID_TRANSITIONS = 50
# Seconds between two handlings of health transitions: 10,000 backends failing at once
# arrive over a round of checks, and handled as they came they made ~400 syncs and scans
# (the loop at 36% of a core, the checks starved); batched, at most 2 a second, each ~0.5 s
# later at worst, well inside the 5 s a dead backend has to leave the choice.
HEALTH_BATCH = 0.5


class Source(Protocol):
    """Where objects come from: a directory or the Kubernetes API."""

    @property
    def ready(self) -> bool: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def poll(self) -> bool: ...
    def take_changes(self) -> set[ObjectKey] | None: ...
    def objects(self) -> list[Any]: ...
    def named(self, kind: str, name: str) -> list[Any]: ...

    def attach(self, wake: Callable[[], None]) -> bool:
        """Call wake() from the source's own threads when something changed; False: it
        cannot (it has a descriptor, or is polled every settings.poll_interval)."""
        ...

    def fileno(self) -> int | None:
        """Readable when poll() has news (an inotify descriptor); None: none."""
        ...

    def next_poll(self) -> float | None:
        """When poll() must be called again (monotonic); None: not until woken."""
        ...

    @property
    def changed_at(self) -> float | None:
        """When the oldest change the last poll() reported was received (unix time); None:
        not known (the loop takes the time it learnt of it)."""
        ...

    @property
    def restarts(self) -> int:
        """Watch streams started after the first one (0: a source with none)."""
        ...

    @property
    def relists(self) -> int:
        """Lists after the first ones (0: a source with none)."""
        ...


class Listening(Protocol):
    """The kernel view as the loop sleeps on it (agent/kernel/view.py's KernelView; in unit
    tests, the fake's)."""

    def fileno(self) -> int | None:
        """Readable when change notifications wait; None: the view has no descriptor, and
        is asked for drift every turn."""
        ...

    def keep_up(self) -> None: ...
    def missed(self) -> bool: ...


class Pipeline(Protocol):
    """What the loop drives (agent/run/reconcile.py's Reconciler)."""

    @property
    def view(self) -> Listening: ...
    @property
    def cleanup(self) -> Cleanup: ...
    @property
    def state(self) -> DesiredState: ...
    def sync(self, catalog: Source, changed: set[ObjectKey] | None) -> SyncResult: ...
    def request_full_sync(self) -> None: ...
    def check_drift(self) -> bool: ...
    def due(self) -> list[float]: ...
    def retire_chains(self) -> None: ...
    def clean_affinity(self) -> int: ...
    def health_down(self, down: frozenset[Any]) -> int: ...
    def take_targets(self) -> Any: ...
    def failing_open(self) -> list[Any]: ...
    def rules_checking(self, targets: Any) -> dict[Any, list[str]]: ...


class Stop(Protocol):
    """The loop's stop flag (StopEvent)."""

    def is_set(self) -> bool: ...

    def attach(self, wake: Callable[[], None]) -> None:
        """Call wake() when set, so the loop stops at once."""
        ...


class Waker:
    """A pipe the loop sleeps on: wake() from any thread (or a signal handler) ends the
    sleep at once."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def wake(self) -> None:
        try:
            os.write(self._write, b"x")
        except BlockingIOError:
            pass  # already awake-pending: the pipe is full of wake-ups

    def wait(self, timeout: float) -> bool:
        """Block at most `timeout` seconds for a wake-up; True if one came."""
        return bool(select.select([self._read], [], [], timeout)[0])

    def clear(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


class StopEvent(threading.Event):
    """A stop flag that also wakes the loop it is given to."""

    _wake: Callable[[], None] | None = None

    def attach(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def set(self) -> None:
        super().set()
        if self._wake is not None:
            self._wake()


def run_loop(settings: Settings, source: Source, reconciler: Pipeline, stop: Stop,
             health: Health | None = None, metrics: Metrics | None = None, checks: HealthChecks | None = None,
             events: Any = None) -> None:
    Loop(settings, source, reconciler, stop, health, metrics, checks=checks, events=events).run()


class Loop:
    """One agent's loop. Survives any exception from any stage: each is logged with its
    context and retried, never a silent thread death. When to do what is its Schedule's
    (agent/run/schedule.py); the loop sleeps, reads and calls."""

    def __init__(self, settings: Settings, source: Source, reconciler: Pipeline, stop: Stop,
                 health: Health | None = None, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic, checks: HealthChecks | None = None,
                 events: Any = None) -> None:
        self.settings = settings
        self.source = source
        self.reconciler = reconciler
        self.stop = stop
        self.health = health or Health(settings.healthz_stale_after, settings.livez_wedged_after)
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.checks = checks  # the backends' health checks (None: off)
        self.events = events  # an EventSink (the Kubernetes path) for health transitions
        self.waker = Waker()
        stop.attach(self.waker.wake)
        self.schedule = Schedule(settings, clock)
        self.listens = False  # the view has a descriptor to sleep on (set by run())
        self.turns = 0  # loop turns so far (tests: an idle agent does not spin)
        self._health_at = -HEALTH_BATCH  # when health transitions were last handled (clock())
        self.syncs = 0

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.waker, selectors.EVENT_READ, "wake")
        kernel_fd = self.reconciler.view.fileno()
        self.listens = kernel_fd is not None
        if kernel_fd is not None:
            selector.register(kernel_fd, selectors.EVENT_READ, "kernel")
        attached = self.source.attach(self.waker.wake)
        source_fd = self.source.fileno()
        if source_fd is not None:
            selector.register(source_fd, selectors.EVENT_READ, "source")
        cleanup = self.reconciler.cleanup
        cleanup.wake, cleanup.report, cleanup.failed = self.waker.wake, self.metrics.cleaned, self.metrics.cleanup_failed
        self.health.poke = self.waker.wake
        cleanup.start()
        if self.checks is not None:
            self.checks.wake = self.waker.wake
            self.checks.prober.start()
            self.reconciler.health_down(self.checks.down())  # what a previous run found down, from the first sync
        try:
            while not self.stop.is_set():
                self.turn(selector, attached or source_fd is not None)
        finally:
            if self.checks is not None:
                self.checks.prober.stop()
                self.checks.keep_down(self.clock(), force=True)
            cleanup.stop()
            selector.close()
            self.waker.close()

    def turn(self, selector: selectors.BaseSelector, wakes: bool) -> None:
        """Sleep until there is work, then do it."""
        schedule = self.schedule
        ready = selector.select(self._timeout(wakes))
        self.turns += 1
        self.health.beat()
        woken = {key.data for key, _ in ready}
        if "wake" in woken or "source" in woken:
            # Only arrivals (the waker) count: the kernel's and the directory's descriptors
            # stay readable until read, and ended no wait early.
            schedule.coalesce(self._arrival)
        self.waker.clear()
        now = self.clock()
        try:
            if self.source.poll():
                schedule.queue(self.source.changed_at)
        except Exception:  # a source bug must not kill the data plane's keeper
            log.exception("source poll failed")
        if self.checks is not None and now >= self._health_at + HEALTH_BATCH:
            self._health(now)
        if schedule.resync_due(now):
            collect_cycles()
            self.reconciler.request_full_sync()
            schedule.queue()
        if "kernel" in woken:
            schedule.notified()
            if schedule.pending:
                # Its socket is level-triggered: left unread while a sync waits (a source not
                # ready, a retry's backoff), it woke the loop at once, every turn: a core spun.
                self.reconciler.view.keep_up()
        if schedule.pending:
            self.health.pending()
            self.metrics.last_queued.set(schedule.queued_at)
        if schedule.sync_due(now, self.source.ready):
            self._sync(now)
        if schedule.drift_check_due(self._kernel_news):
            try:
                if self.reconciler.check_drift():
                    schedule.queue()
            except Exception:
                log.exception("drift check failed; resyncing")
                self.reconciler.request_full_sync()
                schedule.queue()
        self.metrics.watch_counts(self.source.restarts, self.source.relists)
        try:
            self.reconciler.retire_chains()
            deleted = self.reconciler.clean_affinity()
            if deleted:
                self.metrics.affinity_deleted.inc(deleted)
        except Exception:
            log.exception("post-sync cleanup failed")

    def _health(self, now: float) -> None:
        """Backends that went down or came back: said (log, metrics, Events on their rules),
        and the identities they serve rendered at the next sync. Batched: every transition
        since the last handling, at most every HEALTH_BATCH seconds, in one sync."""
        assert self.checks is not None
        self.checks.keep_down(now)
        transitions = self.checks.drain()
        if not transitions:
            return
        self._health_at = now
        rules = self.reconciler.rules_checking({t for t, _ in transitions[:SAID_TRANSITIONS]})
        for n, (target, state) in enumerate(transitions):
            backend, check = target
            self.metrics.health_transition(str(backend), str(check), state.up)
            if n >= SAID_TRANSITIONS:
                continue
            names = rules.get(target, [])
            if state.up:
                log.info("backend up", backend=str(backend), check=str(check), rules=names)
            else:
                log.warning("backend down", backend=str(backend), check=str(check), reason=state.last_failure,
                            rules=names)
            if self.events is not None:
                message = f"backend {backend} is {'up' if state.up else 'down'} ({check})" + (
                    "" if state.up else f": {state.last_failure}")
                for name in names:
                    self.events.warning("IptablesDnatRule", name, "", "BackendUp" if state.up else "BackendDown",
                                        message, type_="Normal" if state.up else "Warning")
        if len(transitions) > SAID_TRANSITIONS:
            log.warning("more backends changed state at once than are said one by one",
                        said=SAID_TRANSITIONS, down=sum(not s.up for _, s in transitions),
                        up=sum(s.up for _, s in transitions))
        self.metrics.health_targets(self.checks.prober.stretch, *self.checks.counts())
        touched = self.reconciler.health_down(self.checks.down())
        if touched:
            log.info("health changed the choice", identities=touched, transitions=len(transitions))
            self.schedule.queue()
        failing = self.reconciler.failing_open()
        if failing:
            log.warning("every backend of these identities is down: keeping them all (fail open)",
                        identities=[str(i) for i in failing[:20]], count=len(failing))
        self.checks.failing_open = [str(i) for i in failing]

    def _timeout(self, wakes: bool) -> float:
        """Seconds until the earliest due timer: the schedule's, systemd's watchdog, the
        source's next poll, the reconciler's."""
        timers = list(self.reconciler.due())
        if (watchdog := self.health.due()) is not None:
            timers.append(watchdog)
        if (at := self.source.next_poll()) is not None:
            timers.append(at)
        if self.checks is not None:
            if self.checks.pending:
                timers.append(self._health_at + HEALTH_BATCH)
            if (at := self.checks.keep_due()) is not None:
                timers.append(at)
        return self.schedule.timeout(self.source.ready, wakes, timers)

    def _arrival(self, timeout: float) -> bool:
        """Whether another change arrives within `timeout` seconds."""
        self.waker.clear()
        return self.waker.wait(timeout)

    def _kernel_news(self) -> bool:
        """Whether to look for drift with no notification read: a view with no descriptor to
        sleep on is asked every turn; one that lost notifications (an overrun, or others'
        commits while it was deaf) at once, as nothing may come to wake the loop for them."""
        return not self.listens or self.reconciler.view.missed()

    def _sync(self, now: float) -> None:
        started = self.clock()
        try:
            result = self.reconciler.sync(self.source, self.source.take_changes())
            self.schedule.synced()
            self.syncs += 1
            self.health.synced()
            _record(self.metrics, self.reconciler, result, self.clock() - started,
                    time.time() - self.schedule.queued_at)
            self.metrics.table_digest.labels(self.settings.gateway).set(result.digest)
            # After the change is in the kernel and timed: ~10 ms at 40,000 targets.
            if self.checks is not None and (targets := self.reconciler.take_targets()) is not None:
                self.checks.follow(targets)
        except ApplyError as err:
            self.health.failed(str(err))
            self.metrics.failures.inc()
            delay = self.schedule.failed(now)
            log.error("apply failed; will read back and retry", kernel_unchanged=not err.partial,
                      rc=err.rc, digest=err.digest, commands=err.commands, error=err.message, retry_in=round(delay, 2))
        except Exception as err:
            self.health.failed(f"{type(err).__name__}: {err}")
            self.metrics.failures.inc()
            delay = self.schedule.failed(now)
            log.exception("sync failed; will read back and retry", retry_in=round(delay, 2))
        if self.schedule.pending:
            self.reconciler.request_full_sync()


def _record(metrics: Metrics, reconciler: Pipeline, result: SyncResult, took: float, waited: float) -> None:
    """`waited`: from the oldest change the sync took being received by the source to the
    kernel holding it (the programming latency; bench/footprint.py reads it from the log)."""
    metrics.sync_duration.labels("partial" if result.partial else "full").observe(took)
    metrics.last_sync.set(time.time())
    if result.commands:
        metrics.programming.observe(waited)
        log.info("synced", **result.__dict__, seconds=round(took, 6), waited=round(waited, 6))
    metrics.identities.set(result.identities)
    metrics.backends.set(result.backends)
    metrics.set_invalid(reconciler.state.errors)
