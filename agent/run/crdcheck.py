"""The CRD check of agent/sources/crd.py, kept up from a thread of its own (the API may be slow or
not there yet): read until one read succeeds, with a capped backoff (right after start a
read often fails: the API attachment is still coming up), then again every `interval`, so
upgrading kube-ovn to a release with share DNAT clears the problem without restarting the
agent (and a downgrade is noticed). Until one read succeeds the agent is not ready and
its status says "CRD not checked yet (reason)"; a failed read after a good one keeps the
last verdict. Events and error logs come once per change of the verdict, not per read."""
from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

import structlog

from agent.backoff import Backoff
from agent.sources.crd import CRD_NAME, problems as crd_problems
from agent.ops.health import Health

log = structlog.get_logger()
CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"
INTERVAL = 600.0  # one get per gateway every 10 minutes: nothing for the API server


class Warner(Protocol):
    def warning(self, kind: str, name: str, uid: str, reason: str, message: str) -> Any: ...


class CrdCheck:
    def __init__(self, read: Callable[[], Any], health: Health, events: Warner | None, gateway: str,
                 backoff: Backoff | None = None, interval: float = INTERVAL) -> None:
        self._read = read
        self._health = health
        self._events = events
        self._gateway = gateway
        self._backoff = backoff or Backoff(1.0, 60.0)
        self._interval = interval
        self._stop = threading.Event()
        self._said: list[str] = []  # this check's entries in health.problems
        self.checked = False
        self._say([not_checked(f"reading {CRD_NAME}")])  # not ready before the first answer either

    def start(self) -> CrdCheck:
        threading.Thread(target=self._work, name="crd", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _work(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(self.check_once())

    def check_once(self) -> float:
        """One read and its verdict; returns the seconds to wait before the next."""
        try:
            crd = self._read()
        except Exception as err:  # forbidden, absent, unreachable: say so, try again
            delay = self._backoff.next()
            reason = _reason(err)
            log.warning("cannot read the CRD; carrying on, reading it again later", crd=CRD_NAME, error=reason,
                        checked_before=self.checked, retry_in=round(delay, 1))
            if not self.checked:
                self._say([not_checked(f"{CRD_NAME}: {reason}")])
            return delay
        self._backoff.reset()
        found = crd_problems(crd if isinstance(crd, dict) else {})
        if found != self._said or not self.checked:
            for problem in found:
                log.error("this cluster cannot work with the agent", problem=problem)
                if self._events is not None:
                    self._events.warning("VpcNatGateway", self._gateway, "", "UnsupportedCRD", problem)
            if not found:
                log.info("CRD checked: it has the share fields", crd=CRD_NAME)
        self.checked = True
        self._say(found)
        return self._interval

    def _say(self, problems: list[str]) -> None:
        # One assignment: the status socket's thread reads health.problems meanwhile.
        previous, self._said = self._said, problems
        self._health.problems = [p for p in self._health.problems if p not in previous] + problems


def reader(api: Any) -> Callable[[], Any]:
    """One read of the CRD through the agent's API client (get on that one name)."""
    from agent.sources.kubeapi import request  # the kubernetes client only where it is used

    return lambda: request(api, "GET", CRD_PATH)


def not_checked(reason: str) -> str:
    return f"CRD not checked yet ({reason})"


def _reason(err: Exception) -> str:
    status = getattr(err, "status", None)  # the client's ApiException
    if status:
        return f"HTTP {status} {getattr(err, 'reason', '') or ''}".strip()
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
