"""What a committed change leaves behind, and who must clear it. Pure: no I/O.

NAT chains see only a flow's first packet, so a flow keeps its backend for as long as its
conntrack entry lives: entries must go when their identity (or, for UDP, their backend)
does, or a client keeps sending into a black hole. Affinity entries of a backend that left
its slot must go before the slot is reused, or its old clients follow the newcomer."""
from __future__ import annotations

from dataclasses import dataclass, field

from agent.layout import SERVICES, affinity_set, identity_key, key_identity, slots_of, sticky_slots
from agent.model import Backend, Identity
from agent.ruleset import ElemKey, Ruleset


@dataclass(frozen=True)
class Leftovers:
    flows: tuple[tuple[Identity, Backend | None], ...] = ()  # (identity, None): all its flows
    affinity: dict[int, frozenset[ElemKey]] = field(default_factory=dict)  # slot -> identity keys stale there


NOTHING = Leftovers()


def leftovers(before: Ruleset, after: Ruleset) -> Leftovers:
    """After a change from `before` to `after` committed: flows of removed identities (and
    UDP flows of removed backends; a TCP flow finishes on its backend), and the affinity
    entries that no longer point at their backend, per slot."""
    if not before.elements.get(SERVICES):
        return NOTHING  # nothing was there to go (a start from an empty table)
    before, after = _differing(before, after)
    if not before.elements.get(SERVICES):
        return NOTHING  # no identity that was there changed
    flows: list[tuple[Identity, Backend | None]] = []
    old_ids = {key_identity(k) for k in before.elements.get(SERVICES, {})}
    new_ids = {key_identity(k) for k in after.elements.get(SERVICES, {})}
    flows += [(identity, None) for identity in sorted(old_ids - new_ids)]
    old_slots, new_slots = slots_of(before), slots_of(after)
    for identity in sorted(old_ids & new_ids):
        if identity.proto != "udp":
            continue  # a TCP flow finishes on its backend; a UDP one would never move
        for backend in sorted(set(old_slots.get(identity, {})) - set(new_slots.get(identity, {}))):
            flows.append((identity, backend))
    stale: dict[int, set[ElemKey]] = {}
    new_sticky = sticky_slots(after)
    for identity, held in sticky_slots(before).items():
        for slot, backend in held.items():
            if new_sticky.get(identity, {}).get(slot) != backend:
                stale.setdefault(slot, set()).add(identity_key(identity))
    affinity = {slot: frozenset(keys) for slot, keys in stale.items()
                if affinity_set(slot) in after.sets}  # else the set itself went, entries with it
    return Leftovers(tuple(flows), affinity)


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
