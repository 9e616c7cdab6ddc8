"""Taking over from the legacy `nat-gateway.sh` path (--take-over-legacy): for identities
the agent programs, the legacy `ip kube-ovn` table's objects are removed, in the agent's
own transaction. The only place the agent touches another table, and only these objects:
the identity's `service-ips` element, its `dnat-<h>` chain and, for ClientIP, its
`ep-<h>-<b>` chains and `aff-<h>-<b>` sets. Pure: the table comes in read back."""
from __future__ import annotations

from typing import Iterable

from agent.core.commands import Command, Table
from agent.core.ruleset import ElemKey, Ruleset, key_json

LEGACY_TABLE = "kube-ovn"
LEGACY_MAP = "service-ips"


def takeover_commands(legacy: Ruleset | None, identities: Iterable[ElemKey], family: str = "ip") -> list[Command]:
    """Commands removing the legacy objects of these identities (none if there are none).

    The agent's base chain runs first (priority -160 against -150), so new connections of
    these identities are already the agent's; established ones keep their conntrack NAT
    binding whatever happens to the rules that made it."""
    if legacy is None or LEGACY_MAP not in legacy.elements:
        return []
    t = Table(family, LEGACY_TABLE)
    elements = legacy.elements[LEGACY_MAP]
    keys = [k for k in identities if k in elements]
    if not keys:
        return []
    chains: list[str] = []
    sets: list[str] = []
    for key in keys:
        target = elements[key].value.get("goto", {}).get("target") if isinstance(elements[key].value, dict) else None
        if not isinstance(target, str) or not target.startswith("dnat-"):
            continue
        suffix = target.removeprefix("dnat-")
        chains += [target, *sorted(c for c in legacy.chains if c.startswith(f"ep-{suffix}-"))]
        sets += sorted(s for s in legacy.sets if s.startswith(f"aff-{suffix}-"))
    commands = [t.delete_elements(LEGACY_MAP, [key_json(k) for k in keys])]
    commands += [t.flush_chain(c) for c in chains if c in legacy.chains]
    commands += [t.delete_chain(c) for c in chains if c in legacy.chains]
    commands += [t.delete_set(s, legacy.sets[s]) for s in sets]
    return commands
