"""The loop that drives the reconciler: it sleeps until there is work -- a source's
change, a kernel change notification, a timer that is due -- and then does it: sync
(changes arriving together within a few milliseconds go as one), repair drift, retry a
failure after a capped, jittered backoff and a full read-back, resync hourly, retire
emptied chains, delete stale affinity entries a slice at a time (the cleanup thread,
agent/run/cleanup.py, finds them and clears conntrack); and it tells health and metrics.

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

from agent.backoff import Backoff
from agent.core.desired import ObjectKey
from agent.errors import ApplyError
from agent.ops.health import Health
from agent.memory import collect_cycles
from agent.ops.metrics import Metrics
from agent.run.reconcile import Reconciler, SyncResult
from agent.settings import Settings

log = structlog.get_logger()

# Quiet that ends the wait for more changes: after a lone change, 1 ms (its own latency);
# within a burst, 2.5 ms: a burst of 20 watch events arrived here with gaps of 0.2-2.2 ms
# (bench/footprint.py), and a 1 ms quiet cut 2 bursts of 10 in two transactions.
LONE_QUIET = 0.001
BURST_QUIET = 0.0025


class Source(Protocol):
    """Where objects come from: a directory or the Kubernetes API. A source may also offer
    `attach(wake)` (it calls wake() from its own threads when something changed),
    `fileno()` (readable when poll() has news: an inotify descriptor), `next_poll()` (when
    it needs poll() called again, monotonic; None: not until woken) and `changed_at`
    (when its oldest change not yet taken was received, unix time)."""

    @property
    def ready(self) -> bool: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def poll(self) -> bool: ...
    def take_changes(self) -> set[ObjectKey] | None: ...
    def objects(self) -> list[Any]: ...
    def named(self, kind: str, name: str) -> list[Any]: ...


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

    waker: Waker | None = None

    def set(self) -> None:
        super().set()
        if self.waker is not None:
            self.waker.wake()


def run_loop(settings: Settings, source: Source, reconciler: Reconciler, stop: threading.Event,
             health: Health | None = None, metrics: Metrics | None = None) -> None:
    Loop(settings, source, reconciler, stop, health, metrics).run()


class Loop:
    """One agent's loop. Survives any exception from any stage: each is logged with its
    context and retried, never a silent thread death."""

    def __init__(self, settings: Settings, source: Source, reconciler: Reconciler, stop: threading.Event,
                 health: Health | None = None, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.source = source
        self.reconciler = reconciler
        self.stop = stop
        self.health = health or Health(settings.healthz_stale_after, settings.livez_wedged_after)
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.waker = Waker()
        if isinstance(stop, StopEvent):
            stop.waker = self.waker
        self.backoff = Backoff(settings.retry_min, settings.retry_max)
        self.pending = True
        self.queued_at = time.time()  # when the oldest change not yet in the kernel was seen
        self.retry_at = 0.0
        self.resync_at = clock() + settings.resync_interval
        self.drift_due = False  # kernel notifications arrived that no drift check has looked at
        self.turns = 0  # loop turns so far (tests: an idle agent does not spin)
        self.syncs = 0

    def queue(self, seen_at: float | None = None) -> None:
        if not self.pending:
            self.pending, self.queued_at = True, seen_at if seen_at is not None else time.time()

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.waker, selectors.EVENT_READ, "wake")
        kernel = getattr(self.reconciler.view, "fileno", None)
        if kernel is not None:
            selector.register(kernel(), selectors.EVENT_READ, "kernel")
        attach = getattr(self.source, "attach", None)
        if attach is not None:
            attach(self.waker.wake)
        source_fd = self._source_fd()
        if source_fd is not None:
            selector.register(source_fd, selectors.EVENT_READ, "source")
        cleanup = self.reconciler.cleanup
        cleanup.wake, cleanup.report = self.waker.wake, self.metrics.cleaned
        self.health.poke = self.waker.wake
        cleanup.start()
        try:
            while not self.stop.is_set():
                self.turn(selector, attach is not None or source_fd is not None)
        finally:
            cleanup.stop()
            selector.close()
            self.waker.close()

    def _source_fd(self) -> int | None:
        fileno = getattr(self.source, "fileno", None)
        return fileno() if fileno is not None else None

    def turn(self, selector: selectors.BaseSelector, wakes: bool) -> None:
        """Sleep until there is work, then do it."""
        ready = selector.select(self._timeout(wakes))
        self.turns += 1
        self.health.beat()
        woken = {key.data for key, _ in ready}
        if "wake" in woken or "source" in woken:
            self._coalesce()
        self.waker.clear()
        now = self.clock()
        try:
            if self.source.poll():
                self.queue(getattr(self.source, "changed_at", None))
        except Exception:  # a source bug must not kill the data plane's keeper
            log.exception("source poll failed")
        if now >= self.resync_at:
            collect_cycles()
            self.reconciler.request_full_sync()
            self.resync_at = now + self.settings.resync_interval
            self.queue()
        if "kernel" in woken:
            self.drift_due = True
            if self.pending:
                # Its socket is level-triggered: left unread while a sync waits (a source not
                # ready, a retry's backoff), it woke the loop at once, every turn: a core spun.
                self.reconciler.view.keep_up()
        if self.pending:
            self.health.pending()
            self.metrics.last_queued.set(self.queued_at)
        if self.pending and self.source.ready and now >= self.retry_at:
            self._sync(now)
        if not self.pending and (self.drift_due or kernel_news(self.reconciler)):
            self.drift_due = False
            try:
                if self.reconciler.check_drift():
                    self.queue()
            except Exception:
                log.exception("drift check failed; resyncing")
                self.reconciler.request_full_sync()
                self.queue()
        restarts = getattr(self.source, "restarts", None)
        if restarts is not None:
            self.metrics.watch_counts(restarts, self.source.relists)  # type: ignore[attr-defined]
        try:
            self.reconciler.retire_chains()
            deleted = self.reconciler.clean_affinity()
            if deleted:
                self.metrics.affinity_deleted.inc(deleted)
        except Exception:
            log.exception("post-sync cleanup failed")

    def _timeout(self, wakes: bool) -> float:
        """Seconds until the earliest due timer (capped: settings.idle_wakeup)."""
        now = self.clock()
        due = [now + self.settings.idle_wakeup, self.resync_at]
        if (watchdog := self.health.due()) is not None:
            due.append(watchdog)
        if self.pending:
            due.append(max(self.retry_at, now) if self.source.ready else now + self.settings.poll_interval)
        if not wakes:
            due.append(now + self.settings.poll_interval)  # a source that cannot wake us: polled
        next_poll = getattr(self.source, "next_poll", None)
        if next_poll is not None and (at := next_poll()) is not None:
            due.append(at)
        due += self.reconciler.due()
        return max(0.0, min(due) - now)

    def _coalesce(self) -> None:
        """Changes that come together go together. A lone change waits LONE_QUIET of quiet;
        once a second one came (a burst), BURST_QUIET; never more than
        settings.coalesce_window in all. Only arrivals (the waker) count: the kernel's and
        the directory's descriptors stay readable until read, and ended no wait early."""
        deadline = self.clock() + self.settings.coalesce_window
        quiet = LONE_QUIET
        while (left := deadline - self.clock()) > 0:
            self.waker.clear()
            if not self.waker.wait(min(quiet, left)):
                return
            quiet = BURST_QUIET

    def _sync(self, now: float) -> None:
        started = self.clock()
        try:
            result = self.reconciler.sync(self.source, self.source.take_changes())
            self.pending = False
            self.syncs += 1
            self.backoff.reset()
            self.health.synced()
            _record(self.metrics, self.reconciler, result, self.clock() - started, time.time() - self.queued_at)
        except ApplyError as err:
            self.health.failed(str(err))
            self.metrics.failures.inc()
            delay = self.backoff.next()
            log.error("apply failed; will read back and retry", kernel_unchanged=not err.partial,
                      rc=err.rc, digest=err.digest, commands=err.commands, error=err.message, retry_in=round(delay, 2))
            self.retry_at = now + delay
        except Exception as err:
            self.health.failed(f"{type(err).__name__}: {err}")
            self.metrics.failures.inc()
            delay = self.backoff.next()
            log.exception("sync failed; will read back and retry", retry_in=round(delay, 2))
            self.retry_at = now + delay
        if self.pending:
            self.reconciler.request_full_sync()


def kernel_news(reconciler: Reconciler) -> bool:
    """Whether to look for drift with no notification read: a view that offers no
    descriptor to sleep on (the fake's) is asked every turn; one that lost notifications
    (an overrun, or others' commits while it was deaf) at once, as nothing may come to
    wake the loop for them."""
    view = reconciler.view
    return getattr(view, "fileno", None) is None or view.missed()


def _record(metrics: Metrics, reconciler: Reconciler, result: SyncResult, took: float, waited: float) -> None:
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
