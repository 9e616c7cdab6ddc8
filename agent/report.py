"""Report: what the pipeline found wrong with the input, said once per change."""
from __future__ import annotations

from typing import Any, Iterable

import structlog

from agent.desired import Desired, desired_services
from agent.errors import RuleError
from agent.model import build_inventory
from agent.settings import Settings

log = structlog.get_logger()


class Reporter:
    """Logs each invalid rule and each disagreement when it appears, not on every sync;
    one that goes away and comes back is reported again."""

    def __init__(self) -> None:
        self._reported: set[tuple[str, ...]] = set()

    def report(self, errors: Iterable[RuleError], notes: Iterable[str]) -> None:
        current: set[tuple[str, ...]] = set()
        for err in errors:
            current.add(err.key())
            if err.key() not in self._reported:
                log.error("invalid rule left out", kind=err.kind, name=err.name, field=err.field, reason=err.reason)
        for note in notes:
            current.add(("note", note))
            if ("note", note) not in self._reported:
                log.warning("rules disagree", detail=note)
        self._reported = current


def evaluate(objects: Iterable[Any], settings: Settings, reporter: Reporter) -> tuple[Desired, int]:
    """Objects -> validated model -> desired services, reporting what was left out.
    Returns the desired state and how many rules were rejected."""
    inventory = build_inventory(objects, settings.gateway)
    desired = desired_services(inventory.rules, settings.max_backends)
    reporter.report(inventory.errors + desired.errors, desired.notes)
    return desired, len(inventory.errors) + len(desired.errors)
