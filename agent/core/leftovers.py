"""What a committed change leaves behind, and who must clear it. Pure: no I/O.

Identities that went: every conntrack entry toward them must go (agent/core/flows.py decides
by state, agent/run/cleanup.py does it). Affinity entries of a backend that left its slot:
they must go before the slot is given to another backend of the identity, or its old
clients follow the newcomer (agent/core/render.py keeps such a slot blocked until then)."""
from __future__ import annotations

from dataclasses import dataclass, field

from agent.core.layout import SERVICES, affinity_set, identity_key, key_identity, sticky_slots
from agent.core.model import Identity
from agent.core.ruleset import ElemKey, Ruleset


@dataclass(frozen=True)
class Leftovers:
    gone: tuple[Identity, ...] = ()  # identities that went: all their flows go
    affinity: dict[int, frozenset[ElemKey]] = field(default_factory=dict)  # slot -> identity keys stale there


NOTHING = Leftovers()


def leftovers(before: Ruleset, after: Ruleset) -> Leftovers:
    """After a change from `before` to `after` committed: the identities that went, and
    the affinity entries that no longer point at their backend, per slot."""
    if not before.elements.get(SERVICES):
        return NOTHING  # nothing was there to go (a start from an empty table)
    before, after = _differing(before, after)
    if not before.elements.get(SERVICES):
        return NOTHING  # no identity that was there changed
    old_ids = {key_identity(k) for k in before.elements.get(SERVICES, {})}
    new_ids = {key_identity(k) for k in after.elements.get(SERVICES, {})}
    stale: dict[int, set[ElemKey]] = {}
    new_sticky = sticky_slots(after)
    for identity, held in sticky_slots(before).items():
        for slot, backend in held.items():
            if new_sticky.get(identity, {}).get(slot) != backend:
                stale.setdefault(slot, set()).add(identity_key(identity))
    affinity = {slot: frozenset(keys) for slot, keys in stale.items()
                if affinity_set(slot) in after.sets}  # else the set itself went, entries with it
    return Leftovers(tuple(sorted(old_ids - new_ids)), affinity)


def _differing(before: Ruleset, after: Ruleset) -> tuple[Ruleset, Ruleset]:
    """Both tables restricted to the elements of identities that differ between them."""
    keys = set()
    for name in set(before.elements) | set(after.elements):
        old, new = before.elements.get(name, {}), after.elements.get(name, {})
        keys.update(k for k, e in old.items() if new.get(k) != e)
        keys.update(k for k, e in new.items() if old.get(k) != e)
    return (Ruleset(before.sets, before.chains, before.rules,
                    {n: {k: e for k, e in m.items() if k in keys} for n, m in before.elements.items()}),
            Ruleset(after.sets, after.chains, after.rules,
                    {n: {k: e for k, e in m.items() if k in keys} for n, m in after.elements.items()}))
