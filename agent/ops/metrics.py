"""Prometheus metrics, named after kube-proxy's where they mean the same thing.

Sync and programming metrics are recorded by the reconcile loop; per-backend packet and
byte counters come from the kernel's per-element nft counters, read in the background
(never on the scrape's thread, never through the loop's sockets), so the load spread is
visible without tcpdump and a scrape costs no kernel work."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

import structlog

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from agent import memory
from agent.errors import RuleError

log = structlog.get_logger()

# Syncs take from under a millisecond (one change) to a few seconds (10,000 identities).
_SYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# The programming latency's: its targets (p50 5 ms, p99 20 ms at 10,000 identities) are bounds.
_PROGRAMMING_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.sync_duration = Histogram(
            "natgw_sync_duration_seconds", "Time of one sync, from the source's objects to the kernel.",
            ["kind"], buckets=_SYNC_BUCKETS, registry=r)
        self.last_sync = Gauge("natgw_sync_last_timestamp_seconds",
                               "When the last successful sync finished (unix time).", registry=r)
        self.last_queued = Gauge("natgw_sync_last_queued_timestamp_seconds",
                                 "When the oldest change not yet in the kernel was seen (unix time).", registry=r)
        self.programming = Histogram(
            "natgw_network_programming_duration_seconds",
            "From a change received by the source to the kernel holding it.", buckets=_PROGRAMMING_BUCKETS, registry=r)
        self.failures = Counter("natgw_sync_failures_total",
                                "Transactions the kernel refused and syncs that raised.", registry=r)
        self.identities = Gauge("natgw_identities", "Identities (EIP:port/proto) programmed.", registry=r)
        self.backends = Gauge("natgw_backends", "Backends programmed, over all identities.", registry=r)
        self.invalid = Gauge("natgw_invalid_rules", "Rules left out, by the field at fault.", ["field"], registry=r)
        self.conntrack_deleted = Counter(
            "natgw_conntrack_entries_deleted_total",
            "Conntrack entries deleted: of identities that went, UDP ones not NATed to a current backend.", registry=r)
        self.affinity_deleted = Counter("natgw_affinity_entries_deleted_total",
                                        "ClientIP affinity entries deleted after their backend left its slot.",
                                        registry=r)
        self.cleanup_duration = Histogram(
            "natgw_cleanup_duration_seconds",
            "One cleanup pass off the loop's path: conntrack (dumps and deletes), affinity-read (set reads).",
            ["kind"], buckets=_SYNC_BUCKETS, registry=r)
        self.watch_restarts = Counter("natgw_watch_restarts_total",
                                      "Watch streams started again after one ended (Kubernetes source).", registry=r)
        self.watch_relists = Counter("natgw_watch_relists_total",
                                     "Lists after the first (410 Gone or failures; Kubernetes source).", registry=r)
        self.health_checked = Gauge("natgw_health_targets", "Backends the health checks follow, by state.",
                                    ["state"], registry=r)
        self.backend_down = Gauge(
            "natgw_backend_down",
            "1 for each checked backend that is down (a series exists only while it is: 40,000 always-present "
            "series would cost the agent ~40 MB).", ["backend", "check"], registry=r)
        self.health_transitions = Counter("natgw_health_transitions_total",
                                          "Backends that went down or came back up.", ["to"], registry=r)
        self.health_stretch = Gauge(
            "natgw_health_interval_stretch",
            "Factor by which the checks' intervals are stretched to keep their CPU budget (1: as configured).",
            registry=r)
        self.masquerade = Gauge(
            "natgw_masquerade",
            "1 when the agent's connections leave the VPC interface SNATed to this replica's address (--masquerade).",
            registry=r)
        self.cleanup_failures = Counter("natgw_cleanup_failures_total",
                                        "Cleanup passes that failed and wait for a retry, by kind (conntrack, affinity).",
                                        ["kind"], registry=r)
        for kind in ("conntrack", "affinity"):  # at 0 from the start: a first failure is an increase
            self.cleanup_failures.labels(kind)
        self.table_digest = Gauge(
            "natgw_table_digest",
            "A digest of what every identity is served by now (backends after the checks, affinity): the input "
            "each replica computes its consistent table from; the replicas of one gateway agree on it.",
            ["gateway"], registry=r)
        # Readiness and health as /readyz and /healthz answer them, read at the scrape (follow()).
        self.ready = Gauge("natgw_ready", "1 once the first full sync is in the kernel and nothing keeps the agent "
                           "from serving (/readyz).", registry=r)
        self.healthy = Gauge("natgw_healthy", "1 while no change has waited too long for the kernel (/healthz).",
                             registry=r)
        # The memory an operator compares with the container's limit: the agent's own
        # (process_resident_memory_bytes) and the limit of its cgroup (+Inf: none).
        ProcessCollector(registry=r)
        Gauge("natgw_memory_limit_bytes", "The memory limit of the agent's cgroup (memory.max; +Inf: none).",
              registry=r).set_function(memory.limit)
        self._fields: set[str] = set()
        self._watch_seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def set_invalid(self, errors: Iterable[RuleError]) -> None:
        counts: dict[str, int] = {}
        for err in errors:
            counts[err.field] = counts.get(err.field, 0) + 1
        with self._lock:
            for field in self._fields - set(counts):
                self.invalid.labels(field).set(0)
            for field, n in counts.items():
                self.invalid.labels(field).set(n)
            self._fields |= set(counts)

    def health_transition(self, backend: str, check: str, up: bool) -> None:
        self.health_transitions.labels("up" if up else "down").inc()
        if up:
            try:
                self.backend_down.remove(backend, check)
            except KeyError:
                pass  # down before a restart of the agent: no series
        else:
            self.backend_down.labels(backend, check).set(1)

    def follow(self, health: Any) -> None:
        """Readiness and health from `health` (agent/ops/health.py's Health) at each scrape."""
        self.ready.set_function(lambda: float(health.readyz()[0]))
        self.healthy.set_function(lambda: float(health.healthz()[0]))

    def health_targets(self, stretch: float, up: int, down: int) -> None:
        self.health_stretch.set(stretch)
        self.health_checked.labels("up").set(up)
        self.health_checked.labels("down").set(down)

    def cleaned(self, kind: str, deleted: int, seconds: float) -> None:
        """A cleanup pass finished (agent/run/cleanup.py's report; any thread)."""
        self.cleanup_duration.labels(kind).observe(seconds)
        if kind == "conntrack" and deleted:
            self.conntrack_deleted.inc(deleted)

    def cleanup_failed(self, kind: str) -> None:
        """A cleanup pass failed and is retried later (agent/run/cleanup.py; any thread)."""
        self.cleanup_failures.labels(kind).inc()

    def watch_counts(self, restarts: int, relists: int) -> None:
        """Bring the watch counters up to a source's running totals."""
        with self._lock:
            for counter, total, seen in ((self.watch_restarts, restarts, "restarts"), (self.watch_relists, relists, "relists")):
                delta = total - self._watch_seen.get(seen, 0)
                if delta > 0:
                    counter.inc(delta)
                    self._watch_seen[seen] = total

    def serve_backend_counters(self, read: Callable[[], Counters], interval: float = 10.0) -> CachedCounters:
        """Export `read()` -- {(identity, backend): (packets, bytes)} from the kernel -- as
        last read in the background (at most every `interval` s, and only while scraped)."""
        self.backends_text = CachedCounters(read, interval)
        return self.backends_text

    def exposition(self) -> bytes:
        """What a scrape answers: the agent's own metrics, rendered now (a few dozen series),
        and the per-backend ones as last rendered in the background (40,000 series at 10,000
        identities x 4 take ~0.3 s to render: never on the scrape, never beside the loop's
        work more than once per reading)."""
        backends = self.backends_text.text() if self.backends_text is not None else b""
        return generate_latest(self.registry) + backends

    backends_text: CachedCounters | None = None


Counters = dict[tuple[str, str], tuple[int, int]]


class CachedCounters:
    """The last reading of `read()`, refreshed and rendered by a thread of its own when a
    scrape finds it older than `interval`: the scrape itself answers at once with what is
    there (at 10,000 identities x 4 a reading takes ~0.2 s of dumps and decoding; a scrape
    every 15 s then costs ~1% of a core, none of it on the request or the loop)."""

    def __init__(self, read: Callable[[], Counters], interval: float) -> None:
        self._read = read
        self.interval = interval
        self._value: Counters = {}
        self._text = b""
        self._read_at = float("-inf")
        self._due = threading.Event()
        self._thread = threading.Thread(target=self._work, name="counters", daemon=True)
        self._thread.start()

    def get(self) -> Counters:
        self._ask()
        return self._value

    def text(self) -> bytes:
        self._ask()
        return self._text

    def _ask(self) -> None:
        if time.monotonic() - self._read_at >= self.interval:
            self._due.set()

    def _work(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            try:
                value = self._read()
                registry = CollectorRegistry()
                registry.register(_BackendCounters(lambda: value))
                self._value, self._text = value, generate_latest(registry)
            except Exception as err:  # the table may be gone or busy: keep the last reading
                log.warning("backend counters not read", error=f"{type(err).__name__}: {err}")
            self._read_at = time.monotonic()


class _BackendCounters(Collector):
    def __init__(self, read: Callable[[], Counters]) -> None:
        self._read = read

    def collect(self) -> Iterable[Any]:
        packets = CounterMetricFamily("natgw_backend_packets", "New connections' first packets DNATed to a backend "
                                      "(nft element counter; NAT chains see only a flow's first packet).",
                                      labels=["identity", "backend"])
        octets = CounterMetricFamily("natgw_backend_bytes", "Bytes of those packets.", labels=["identity", "backend"])
        for (identity, backend), (p, b) in sorted(self._read().items()):
            packets.add_metric([identity, backend], p)
            octets.add_metric([identity, backend], b)
        return [packets, octets]
