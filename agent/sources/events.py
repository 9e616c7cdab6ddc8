"""Kubernetes Events at the edge: Warning Events on the objects the agent could not use,
created from a background thread so a slow API server never delays the data plane.

Status is never written: the kube-ovn controller merge-patches the whole status of these
objects from its cache and would overwrite anything the agent put there."""
from __future__ import annotations

import queue
import threading
import time
from datetime import datetime, timezone
from typing import Any

import structlog

from agent.sources.kubeapi import request

log = structlog.get_logger()
COMPONENT = "natgw-agent"


class EventRecorder:
    def __init__(self, api: Any, namespace: str, host: str, capacity: int = 1000) -> None:
        self._api = api  # a kubernetes.client.ApiClient
        self._namespace = namespace
        self._host = host
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._work, name="events", daemon=True)
        self.sent = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 0.3) -> None:
        """Send what is queued (for up to `timeout`: the agent stops within a second of
        SIGTERM; what an unreachable API has not taken by then is dropped), then stop."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def warning(self, kind: str, name: str, uid: str, reason: str, message: str,
                api_version: str = "kubeovn.io/v1", type_: str = "Warning") -> None:
        """An Event on the object (a Warning; type_="Normal" for news that is good: a backend
        back up)."""
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            # client-go's naming: the object's name and a unique suffix.
            "metadata": {"name": f"{name}.{time.time_ns():x}", "namespace": self._namespace},
            "involvedObject": {"apiVersion": api_version, "kind": kind, "name": name, **({"uid": uid} if uid else {})},
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": COMPONENT, "host": self._host},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._host,
        }
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            log.warning("event dropped: queue full", kind=kind, name=name, reason=reason)

    def _work(self) -> None:
        while (body := self._queue.get()) is not None:
            try:
                request(self._api, "POST", f"/api/v1/namespaces/{self._namespace}/events", body)
                self.sent += 1
            except Exception as err:  # the API may be down; an Event is not worth a retry storm
                log.warning("event not recorded", name=body["involvedObject"]["name"],
                            reason=body["reason"], error=f"{type(err).__name__}: {err}")

