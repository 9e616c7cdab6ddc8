"""Desired state per identity: the rules of one EIP:port/proto grouped into one service.
Pure: no I/O."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from agent.errors import RuleError
from agent.model import RULE_KIND, Backend, Identity, Rule


@dataclass(frozen=True)
class Service:
    """What one identity must do in the data plane."""

    identity: Identity
    backends: tuple[Backend, ...]  # sorted, de-duplicated
    affinity: bool
    timeout: int  # seconds; meaningful only with affinity
    rules: dict[Backend, tuple[str, ...]]  # source rule names per backend, sorted

    @property
    def rule_names(self) -> tuple[str, ...]:
        return tuple(sorted({n for names in self.rules.values() for n in names}))


@dataclass(frozen=True)
class Desired:
    services: dict[Identity, Service]
    errors: tuple[RuleError, ...]  # identities refused as a whole (e.g. too many backends)
    notes: tuple[str, ...]  # sibling disagreements, resolved deterministically


def desired_services(rules: Iterable[Rule], max_backends: int) -> Desired:
    """Group rules by identity.

    Siblings that disagree on affinity (admission normally forbids it) resolve the same way
    every time: ClientIP if any sibling asks for it, with the longest timeout among those
    that do. Stickiness is the safe side: a client that needs it breaks without it, one
    that does not is still served.
    """
    grouped: dict[Identity, list[Rule]] = defaultdict(list)
    for rule in rules:
        grouped[rule.identity].append(rule)
    services: dict[Identity, Service] = {}
    errors: list[RuleError] = []
    notes: list[str] = []
    for identity, members in sorted(grouped.items()):
        names: dict[Backend, set[str]] = defaultdict(set)
        for rule in members:
            names[rule.backend].add(rule.name)
        if len(names) > max_backends:
            for rule in sorted(members, key=lambda r: r.name):
                errors.append(
                    RuleError(RULE_KIND, rule.name, "spec.internalIp",
                              f"identity {identity} has {len(names)} backends, more than the limit {max_backends}")
                )
            continue
        sticky = [r for r in members if r.affinity]
        timeouts = {r.timeout for r in sticky}
        if sticky and (len(sticky) != len(members) or len(timeouts) > 1):
            notes.append(
                f"identity {identity}: rules disagree on session affinity; using ClientIP with timeout {max(timeouts)}s"
            )
        services[identity] = Service(
            identity=identity,
            backends=tuple(sorted(names)),
            affinity=bool(sticky),
            timeout=max(timeouts) if sticky else 0,
            rules={b: tuple(sorted(n)) for b, n in sorted(names.items())},
        )
    return Desired(services=services, errors=tuple(errors), notes=tuple(notes))
