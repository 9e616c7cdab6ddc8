"""Health endpoints (and /metrics), kube-proxy's way: /healthz fails when a change has waited too long
(or the agent cannot converge), /livez only when the loop is wedged, /readyz after the
first full sync. JSON bodies say why."""
from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST

from agent import memory
from agent.ops.httpserve import BoundedServer, host_port, respond

from agent.ops.sdnotify import Notifier


class Health:
    """Updated by the reconcile loop; read by the HTTP handlers (thread-safe enough: each
    field is one reference assignment)."""

    def __init__(self, stale_after: float, wedged_after: float, clock: Callable[[], float] = time.monotonic,
                 notifier: Notifier | None = None, programmed: Path | None = None) -> None:
        self.stale_after = stale_after
        self.wedged_after = wedged_after
        self._clock = clock
        self._notifier = notifier or Notifier()
        self.synced_once = False
        self.pending_since: float | None = None  # oldest change not yet in the kernel
        self.last_error: str | None = None
        self.heartbeat = clock()
        self.problems: list[str] = []  # what keeps the agent from serving at all (said by `show`)
        self.poke: Callable[[], None] | None = None  # wakes the loop (set by it): liveness asks, no heartbeat timer
        self._beaten = threading.Event()
        # Written at the first full sync: this pod's data plane was programmed whole once
        # (the state directory outlives a worker, not the pod). `health --routable` reads it.
        self.programmed = programmed

    def beat(self) -> None:
        self.heartbeat = self._clock()
        self._beaten.set()
        self._notifier.watchdog()

    def due(self) -> float | None:
        """When the loop must turn next to keep systemd's watchdog fed (None: no watchdog)."""
        return self._notifier.due()

    def pending(self) -> None:
        if self.pending_since is None:
            self.pending_since = self._clock()

    def synced(self) -> None:
        self._notifier.ready()
        if not self.synced_once and self.programmed is not None:
            try:
                self.programmed.touch()
            except OSError:
                pass  # `health --routable` then says not routable: the safe side
        self.synced_once = True
        self.pending_since = None
        self.last_error = None

    def failed(self, error: str) -> None:
        self.last_error = error

    def healthz(self) -> tuple[bool, dict[str, Any]]:
        waited = 0.0 if self.pending_since is None else self._clock() - self.pending_since
        if waited > self.stale_after:
            return False, {"status": "unhealthy", "reason": f"a change has waited {waited:.1f}s (limit {self.stale_after:.0f}s)",
                           "lastError": self.last_error}
        return True, {"status": "ok", "pendingSeconds": round(waited, 3), "lastError": self.last_error}

    def livez(self) -> tuple[bool, dict[str, Any]]:
        """Asked, a loop asleep for a while is woken and given half a second to turn: an
        idle loop needs no heartbeat timer (each wake-up of an idle process cost ~25 ms of
        CPU here), and a wedged one does not answer."""
        if self.poke is not None and self._clock() - self.heartbeat > min(1.0, self.wedged_after / 2):
            self._beaten.clear()
            self.poke()
            self._beaten.wait(0.5)
        silent = self._clock() - self.heartbeat
        if silent > self.wedged_after:
            return False, {"status": "wedged", "reason": f"the loop has not run for {silent:.1f}s"}
        return True, {"status": "ok"}

    def readyz(self) -> tuple[bool, dict[str, Any]]:
        if self.problems:
            return False, {"status": "not ready", "reason": "; ".join(self.problems)}
        if not self.synced_once:
            return False, {"status": "not ready", "reason": "no full sync yet"}
        return True, {"status": "ok"}

    def answer(self, capabilities: Any, checks: Callable[[], dict[str, Any]] | None = None,
               dataplane: dict[str, Any] | None = None) -> Callable[[str], tuple[bool, dict[str, Any]]]:
        """Answers for the status socket (agent/ops/status.py): ready, live, status, memory;
        `checks`: the backends' health (agent/run/checks.py's snapshot), in the status;
        `dataplane`: the settings that shape the table (masquerade...), for `diff` and `show`."""
        def answer(query: str) -> tuple[bool, dict[str, Any]]:
            if query == "ready":
                return self.readyz()
            if query == "live":
                return self.livez()
            if query == "memory":
                return True, memory.usage()
            ready, why = self.readyz()
            return ready, {"ready": ready, "live": self.livez()[0], "healthy": self.healthz()[0], "pid": os.getpid(),
                           "reason": why.get("reason"), "problems": list(self.problems),
                           "capabilities": capabilities.as_dict(), "lastError": self.last_error,
                           "memory": memory.resident(), **({"health": checks()} if checks else {}),
                           **({"dataplane": dataplane} if dataplane is not None else {})}
        return answer


def serve(health: Health, address: str, metrics: Any = None) -> BoundedServer:
    """Serve the endpoints (and /metrics, given the Metrics) on host:port from a daemon
    thread, four requests at a time at most, five seconds each; returns the server."""
    routes = {"/healthz": health.healthz, "/livez": health.livez, "/readyz": health.readyz}
    if metrics is not None:
        metrics.follow(health)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?")[0] == "/metrics" and metrics is not None:
                respond(self, 200, CONTENT_TYPE_LATEST, metrics.exposition())
                return
            check = routes.get(self.path.split("?")[0])
            ok, body = check() if check else (False, {"status": "not found"})
            respond(self, 200 if ok else (404 if check is None else 503), "application/json", json.dumps(body).encode())

        def log_message(self, *args: Any) -> None:
            pass  # probes every few seconds would drown the agent's own log

    return BoundedServer(host_port(address), Handler, limit=4, timeout=5.0).start("health")
