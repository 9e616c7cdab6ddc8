"""Report: what the pipeline found wrong with the input, said once per change."""
from __future__ import annotations

from typing import Iterable, Protocol

import structlog

from agent.errors import ApplyError, RuleError

log = structlog.get_logger()


class EventSink(Protocol):
    def warning(self, kind: str, name: str, uid: str, reason: str, message: str,
                api_version: str = "kubeovn.io/v1", type_: str = "Warning") -> None: ...


class Reporter:
    """Logs (and, given an event sink, records a Warning Event for) each invalid rule and
    each disagreement when it appears: once per change of the object, not once per sync.
    One that goes away and comes back is reported again."""

    def __init__(self, events: EventSink | None = None, gateway: str = "") -> None:
        self._reported: set[tuple[str, ...]] = set()
        self._events = events
        self._gateway = gateway
        self._failed_digest: str | None = None

    def report(self, errors: Iterable[RuleError], notes: Iterable[str]) -> None:
        current: set[tuple[str, ...]] = set()
        for err in errors:
            current.add(err.key())
            if err.key() not in self._reported:
                log.error("invalid rule left out", kind=err.kind, name=err.name, field=err.field, reason=err.reason)
                if self._events is not None:
                    self._events.warning(err.kind, err.name, err.uid, "InvalidRule", f"{err.field}: {err.reason}")
        for note in notes:
            current.add(("note", note))
            if ("note", note) not in self._reported:
                log.warning("rules disagree", detail=note)
        self._reported = current

    def apply_failed(self, err: ApplyError) -> None:
        """A Warning Event on the gateway for a refused transaction, once per distinct batch
        (the retries of one change do not repeat it)."""
        if self._events is not None and err.digest != self._failed_digest:
            self._events.warning("VpcNatGateway", self._gateway, "", "ApplyFailed",
                                 f"nftables refused the transaction (digest {err.digest}, {err.commands} commands): {err.message}")
        self._failed_digest = err.digest

    def apply_succeeded(self) -> None:
        self._failed_digest = None

