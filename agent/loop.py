"""The loop that drives the reconciler from a source: poll the source, sync on change,
retry failures with capped, jittered backoff and a full read-back, check for drift,
resync periodically; and what it tells health and metrics."""
from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import structlog

from agent.backoff import Backoff
from agent.desired import ObjectKey
from agent.errors import ApplyError
from agent.health import Health
from agent.memory import collect_cycles
from agent.metrics import Metrics
from agent.reconcile import Reconciler, SyncResult
from agent.settings import Settings

log = structlog.get_logger()


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


def run_loop(settings: Settings, source: Source, reconciler: Reconciler, stop: threading.Event,
             health: Health | None = None, metrics: Metrics | None = None) -> None:
    """Poll the source, sync on change, retry failures with capped, jittered backoff and a
    full read-back, check for drift, resync periodically. Survives any exception from any
    stage: each is logged with its context and retried, never a silent thread death."""
    health = health or Health(settings.healthz_stale_after, settings.livez_wedged_after)
    metrics = metrics or Metrics()
    backoff = Backoff(settings.retry_min, settings.retry_max)
    pending = True
    queued_at = time.time()  # when the oldest change not yet in the kernel was seen

    def queue() -> None:
        nonlocal pending, queued_at
        if not pending:
            pending, queued_at = True, time.time()
    retry_at = 0.0
    now = time.monotonic()
    resync_at = now + settings.resync_interval
    while not stop.is_set():
        health.beat()
        now = time.monotonic()
        try:
            if source.poll():
                queue()
        except Exception:  # a source bug must not kill the data plane's keeper
            log.exception("source poll failed")
        if now >= resync_at:
            collect_cycles()
            reconciler.request_full_sync()
            resync_at = now + settings.resync_interval
            queue()
        if not pending:  # after the sync: its notifications wait in their socket meanwhile
            try:
                if reconciler.check_drift():
                    queue()
            except Exception:
                log.exception("drift check failed; resyncing")
                reconciler.request_full_sync()
                queue()
        if pending:
            health.pending()
            metrics.last_queued.set(queued_at)
        if pending and source.ready and now >= retry_at:
            started = time.monotonic()
            try:
                result = reconciler.sync(source, source.take_changes())
                pending = False
                backoff.reset()
                health.synced()
                _record(metrics, reconciler, result, time.monotonic() - started, time.time() - queued_at)
            except ApplyError as err:
                health.failed(str(err))
                metrics.failures.inc()
                delay = backoff.next()
                log.error("apply failed; will read back and retry", kernel_unchanged=not err.partial,
                          rc=err.rc, digest=err.digest, commands=err.commands, error=err.message, retry_in=round(delay, 2))
                retry_at = now + delay
            except Exception as err:
                health.failed(f"{type(err).__name__}: {err}")
                metrics.failures.inc()
                delay = backoff.next()
                log.exception("sync failed; will read back and retry", retry_in=round(delay, 2))
                retry_at = now + delay
            if pending:
                reconciler.request_full_sync()
        if hasattr(source, "restarts"):
            metrics.watch_counts(source.restarts, source.relists)  # type: ignore[attr-defined]
        try:
            reconciler.retire_chains()
            reconciler.clean_affinity()
        except Exception:
            log.exception("post-sync cleanup failed")
        stop.wait(settings.poll_interval)


def _record(metrics: Metrics, reconciler: Reconciler, result: SyncResult, took: float, waited: float) -> None:
    metrics.sync_duration.labels("partial" if result.partial else "full").observe(took)
    metrics.last_sync.set(time.time())
    if result.commands:
        metrics.programming.observe(waited)
    metrics.identities.set(result.identities)
    metrics.backends.set(result.backends)
    metrics.set_invalid(reconciler.state.errors)
    if result.flows_deleted:
        metrics.conntrack_deleted.inc(result.flows_deleted)
