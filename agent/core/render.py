"""Desired services -> the table's content (a Ruleset), all of it or for the identities that
changed. Pure: no I/O. The layout it fills (names, why this shape) is agent/core/layout.py's.

`Renderer` keeps what incremental rendering needs between syncs: each identity's pieces
(its elements, and the shared objects they lead to) and how many identities need each
shared object, so a change renders and plans only the identities it touches."""
from __future__ import annotations

import functools
import itertools
from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Collection, Mapping, NamedTuple

from agent.core.desired import Service
from agent.core.consistent import SEED, SIZE, table
from agent.core.layout import (BACKEND_DATA, BASE_CHAIN, CHASH, CONSISTENT_CHAIN, IDENTITY_TYPE, SERVICES,
                               SNAT_CHAIN, Slots, affinity_set, backend_map, bucket_chain, chash_map, elements_under,
                               held_slots, identity_key, pattern_chain, slot_chain, slots_of, sticky_chain)
from agent.core.model import Backend, Identity
from agent.core.ruleset import EMPTY, Buckets, Elem, ElemKey, Ruleset, goto, truncate_comment
from agent.settings import Settings

_DADDR = {"payload": {"protocol": "ip", "field": "daddr"}}
_SADDR = {"payload": {"protocol": "ip", "field": "saddr"}}
_IDENTITY = [_DADDR, {"meta": {"key": "l4proto"}}, {"payload": {"protocol": "th", "field": "dport"}}]
_MARK = {"meta": {"key": "mark"}}
_CT_MARK = {"ct": {"key": "mark"}}


def _marked(mark: dict[str, Any], bits: int) -> dict[str, Any]:
    return {"match": {"op": "==", "left": {"&": [mark, bits]}, "right": bits}}


class Snat(NamedTuple):
    """What the agent SNATs itself, in a postrouting chain of its table; a mark set in the
    identity's slot chain (only the agent's identities, only a flow's first packet) tells
    that chain which flows are its own.

    `hairpin` (settings.hairpin_snat, outside Kubernetes): packet mark bits. A client on the
    VPC side (`interface`) reaching an identity gets the EIP as its source toward the
    backend, so the backend answers through the gateway (it would answer the client
    directly, from its own address, and the client would drop it).

    `masquerade` (settings.masquerade, an HA gateway's replicas): a conntrack mark bit.
    Every flow the agent DNATs leaves `interface` with this replica's address there as its
    source, so the answer comes back to the replica holding its conntrack entry. The
    connection's mark, not the packet's: kube-ovn owns the packet mark."""

    interface: str
    hairpin: int | None = None
    masquerade: int | None = None


def snat_of(settings: Settings) -> Snat | None:
    if not settings.hairpin_snat and not settings.masquerade:
        return None
    return Snat(settings.vpc_interface, settings.hairpin_mark if settings.hairpin_snat else None,
                settings.masquerade_mark if settings.masquerade else None)


@dataclass(frozen=True)
class Shared:
    """A chain, set or map that identities share: declared while any of them needs it."""

    kind: str  # "chain" or "set" (a map is a set whose declaration has "map")
    decl: dict[str, Any]
    rules: tuple[dict[str, Any], ...] = ()


class Pieces(NamedTuple):
    """What one identity puts into the table: one element (under its key) in each of
    some maps, and the shared objects those elements lead to. (Tuples: the renderer keeps
    one per identity; a dict of its elements cost 3 MB more at 10,000.)"""

    key: ElemKey
    names: tuple[str, ...]  # the maps holding its elements (the same tuple for every identity of a pattern)
    elems: tuple[Elem, ...]  # its element in each of them, in that order
    shared: Mapping[str, Shared]  # the same (read-only) mapping for every identity of a pattern

    @property
    def elements(self) -> dict[str, Elem]:
        """Map name -> this identity's element."""
        return dict(zip(self.names, self.elems))


@dataclass(frozen=True)
class Change:
    """One sync's input to the planner: the table before and wanted (all of it, or only the
    changed identities' elements with every shared object), and what the renderer
    remembers once the kernel took it."""

    full: bool  # every identity was rendered (else only `changed`)
    before: Ruleset
    wanted: Ruleset
    pieces: dict[Identity, Pieces]  # the rendered identities' new pieces
    changed: frozenset[Identity]
    usage: Counter[str]  # shared object -> change in the number of identities needing it


NO_BLOCKS: Mapping[Identity, Collection[int]] = MappingProxyType({})


def assign_slots(services: Mapping[Identity, Service], previous: Slots,
                 blocked: Mapping[Identity, Collection[int]] = NO_BLOCKS) -> Slots:
    """Keep every surviving backend in its slot; give new ones the lowest free slots. Not
    free for a ClientIP identity: a slot a departing backend held in `previous`, and any
    slot `blocked` for it (agent/run/cleanup.py): its old clients' affinity entries are still
    there, and would send them to the newcomer."""
    result: Slots = {}
    for identity, service in services.items():
        before = previous.get(identity)
        held = blocked.get(identity, ())
        if not before and not held:  # a new identity (every one, on a start from an empty table)
            result[identity] = dict(zip(service.backends, range(len(service.backends))))
            continue
        before = before or {}
        kept = {b: s for b, s in before.items() if b in service.backends}
        taken = set(kept.values()) | set(held)
        if service.affinity:
            taken |= set(before.values())
        free = (s for s in itertools.count() if s not in taken)
        for backend in service.backends:
            if backend not in kept:
                kept[backend] = next(free)
        result[identity] = kept
    return result


def render_all(services: Mapping[Identity, Service], previous: Ruleset, affinity_set_size: int,
               priority: int, blocked: Mapping[Identity, Collection[int]] = NO_BLOCKS,
               snat: Snat | None = None, consistent: bool = True) -> tuple[Ruleset, dict[Identity, Pieces]]:
    """The whole table, and each identity's pieces of it."""
    slots = assign_slots(services, slots_of(previous), blocked)
    pieces = {i: render_service(s, slots[i], affinity_set_size, snat, consistent)
              for i, s in sorted(services.items())}
    rs = base_ruleset(priority, snat)
    declared: set[int] = set()  # ids of the shared mappings declared so far
    for p in pieces.values():
        _add_pieces(rs, p, id(p.shared) not in declared)
        declared.add(id(p.shared))
    return rs, pieces


def base_ruleset(priority: int, snat: Snat | None = None) -> Ruleset:
    """The table with no identity: the base chain and its dispatch map (and, with the
    hairpin SNAT or masquerade, the postrouting chain)."""
    rs = Ruleset()
    rs.sets[SERVICES] = {"type": IDENTITY_TYPE, "map": "verdict"}
    rs.chains[BASE_CHAIN] = {"type": "nat", "hook": "prerouting", "prio": priority, "policy": "accept"}
    rs.rules[BASE_CHAIN] = (_rule({"vmap": {"key": {"concat": _IDENTITY}, "data": f"@{SERVICES}"}}),)
    rs.elements[SERVICES] = {}
    if snat is not None:
        # srcnat - 1: before iptables' nat POSTROUTING (kube-ovn's own hairpin rule). A flow is
        # SNATed once, by the first chain that binds it: with both in place, never twice.
        rs.chains[SNAT_CHAIN] = {"type": "nat", "hook": "postrouting", "prio": 99, "policy": "accept"}
        leaving = {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": snat.interface}}
        rules = []
        if snat.hairpin is not None:
            rules.append(_rule(leaving, _marked(_MARK, snat.hairpin),
                               {"snat": {"family": "ip", "addr": {"ct": {"key": "ip daddr", "dir": "original"}},
                                         "flags": ["fully-random"]}}))
        if snat.masquerade is not None:
            rules.append(_rule(leaving, _marked(_CT_MARK, snat.masquerade),
                               {"masquerade": {"flags": ["fully-random"]}}))
        rs.rules[SNAT_CHAIN] = tuple(rules)
    return rs


def _add_pieces(rs: Ruleset, pieces: Pieces, shared: bool = True) -> None:
    if shared:
        for name, definition in pieces.shared.items():
            _declare(rs, name, definition)
    for name, elem in zip(pieces.names, pieces.elems):
        rs.elements[name][pieces.key] = elem


def _declare(rs: Ruleset, name: str, shared: Shared) -> None:
    if shared.kind == "chain":
        rs.chains[name] = shared.decl
        rs.rules[name] = shared.rules
    else:
        rs.sets[name] = shared.decl
        if "map" in shared.decl:
            rs.elements.setdefault(elements_under(name), {})


def _undeclare(rs: Ruleset, name: str) -> None:
    for table in (rs.chains, rs.rules, rs.sets):
        table.pop(name, None)
    rs.elements.pop(elements_under(name), None)


def render_service(service: Service, held: Mapping[Backend, int], affinity_set_size: int,
                   snat: Snat | None = None, consistent: bool = True) -> Pieces:
    """One identity's elements and the shared objects they need, its backends in `held`
    slots; with `consistent` (settings.consistent_choice), a ClientIP identity's buckets."""
    key = identity_key(service.identity)
    order = tuple(sorted(held.values()))
    timeout = service.timeout if service.affinity else None
    target = pattern_chain(order, timeout)
    by_slot = sorted(held.items(), key=lambda item: item[1])
    elems: tuple[Any, ...] = (Elem(goto(target), truncate_comment(service.rule_names)),
                              *(b for b, _ in by_slot))  # a Backend is its own element
    chash = consistent and timeout is not None
    if chash:
        elems = (*elems, buckets(service.backends, held, timeout))  # type: ignore[arg-type]
    return Pieces(key, _names(order, chash), elems, _shared(order, timeout, affinity_set_size, snat, chash))


def buckets(backends: Collection[Backend], held: Mapping[Backend, int], timeout: int) -> Buckets:
    """A ClientIP identity's elements in the chash maps: for each bucket, the sticky chain of
    the slot its backend (consistent.table's) holds here. The table is the same on every
    replica; the slots may differ, and the chains they name lead to the same backends."""
    return Buckets(goto(sticky_chain(held[b], timeout)) for b in table(backends))


@functools.lru_cache(maxsize=4096)
def _names(order: tuple[int, ...], chash: bool) -> tuple[str, ...]:
    """The maps an identity with backends in these slots has elements in."""
    return (SERVICES, *(backend_map(slot) for slot in order), *((CHASH,) if chash else ()))


class Renderer:
    """Renders the whole table or only changed identities, and remembers each identity's
    pieces as the kernel holds them (after `commit`), so the next change starts there."""

    def __init__(self, affinity_set_size: int, priority: int, snat: Snat | None = None,
                 consistent: bool = True) -> None:
        self.affinity_set_size = affinity_set_size
        self.priority = priority
        self.snat = snat
        self.consistent = consistent
        self._pieces: dict[Identity, Pieces] = {}  # per identity, as the kernel holds it
        self._usage: Counter[str] = Counter()  # shared object -> identities needing it

    def full(self, services: Mapping[Identity, Service], before: Ruleset | None,
             blocked: Mapping[Identity, Collection[int]] = NO_BLOCKS) -> Change:
        """Every identity, with the slots `before` (the kernel's table) holds."""
        before = before or EMPTY
        wanted, pieces = render_all(services, before, self.affinity_set_size, self.priority, blocked, self.snat,
                                    self.consistent)
        return Change(True, before, wanted, pieces, frozenset(pieces), Counter())

    def partial(self, services: Mapping[Identity, Service], changed: Collection[Identity], mirror: Ruleset,
                blocked: Mapping[Identity, Collection[int]] = NO_BLOCKS) -> Change:
        """The mirror and the desired table restricted to the changed identities' elements,
        with every shared object: what plan() needs to diff just those identities."""
        before, wanted = _shell(mirror), _shell(mirror)
        usage: Counter[str] = Counter()
        pieces: dict[Identity, Pieces] = {}
        definitions: dict[str, Shared] = {}
        for identity in changed:
            old = self._pieces.get(identity)
            if old is not None:
                for name, elem in zip(old.names, old.elems):
                    before.elements[name][old.key] = elem
                usage.subtract(old.shared.keys())
            service = services.get(identity)
            if service is not None:
                previous = {identity: held_slots(old.elements)} if old else {}
                held = assign_slots({identity: service}, previous, blocked)[identity]
                new = pieces[identity] = render_service(service, held, self.affinity_set_size, self.snat,
                                                        self.consistent)
                usage.update(new.shared.keys())
                definitions.update(new.shared)
        for name, delta in usage.items():
            had = self._usage[name]
            if had == 0 and delta > 0:
                _declare(wanted, name, definitions[name])
            elif had > 0 and had + delta == 0:
                _undeclare(wanted, name)
        for new in pieces.values():
            for name, elem in zip(new.names, new.elems):
                wanted.elements[name][new.key] = elem
        return Change(False, before, wanted, pieces, frozenset(changed), usage)

    def commit(self, change: Change) -> None:
        """The kernel took the change: remember its pieces."""
        if change.full:
            self._pieces = change.pieces
            patterns = Counter(id(p.shared) for p in change.pieces.values())
            shared = {id(p.shared): p.shared for p in change.pieces.values()}
            self._usage = Counter()
            for key, count in patterns.items():
                for name in shared[key]:
                    self._usage[name] += count
            return
        for identity in change.changed:
            self._pieces.pop(identity, None)
        self._pieces.update(change.pieces)
        self._usage.update(change.usage)
        self._usage = +self._usage  # drop the zeros


def _shell(rs: Ruleset) -> Ruleset:
    """The shared part of a table (declarations and chains) with empty maps."""
    return Ruleset(dict(rs.sets), dict(rs.chains), dict(rs.rules), {name: {} for name in rs.elements})


def _rule(*expr: Any) -> dict[str, Any]:
    return {"expr": list(expr)}


def _numgen_vmap(targets: list[str]) -> dict[str, Any]:
    return {
        "vmap": {
            "key": {"numgen": {"mode": "random", "mod": len(targets), "offset": 0}},
            "data": {"set": [[i, {"goto": {"target": t}}] for i, t in enumerate(targets)]},
        }
    }


# Shared definitions are pure functions of their names' parameters: build each once.
@functools.lru_cache(maxsize=4096)
def _shared(order: tuple[int, ...], timeout: int | None, size: int, snat: Snat | None,
            chash: bool) -> Mapping[str, Shared]:
    """Everything an identity with backends in these slots needs declared (read-only: one
    mapping serves every identity of the pattern)."""
    shared = {pattern_chain(order, timeout): _pattern(order, timeout, chash)}
    if chash:
        shared.update(_CONSISTENT)
    for slot in order:
        shared.update(_slot(slot, snat))
        if timeout is not None:
            shared.update(_sticky(slot, timeout, size))
    return MappingProxyType(shared)


def _consistent() -> dict[str, Shared]:
    """The chains and maps of the consistent choice (layout.py), shared by every ClientIP
    identity: a client's bucket, then the identity's element in that bucket's map."""
    buckets = range(SIZE)
    choose = _rule({"vmap": {"key": {"jhash": {"mod": SIZE, "seed": SEED, "expr": _SADDR}},
                             "data": {"set": [[b, {"goto": {"target": bucket_chain(b)}}] for b in buckets]}}})
    shared = {CONSISTENT_CHAIN: Shared("chain", {}, (choose,))}
    for b in buckets:
        shared[bucket_chain(b)] = Shared("chain", {}, (_rule({"vmap": {"key": {"concat": _IDENTITY},
                                                                         "data": f"@{chash_map(b)}"}}),))
        shared[chash_map(b)] = Shared("set", {"type": IDENTITY_TYPE, "map": "verdict"})
    return shared


_CONSISTENT = _consistent()


@functools.lru_cache(maxsize=4096)
def _pattern(order: tuple[int, ...], timeout: int | None, chash: bool) -> Shared:
    if timeout is None:
        return Shared("chain", {}, (_rule(_numgen_vmap([slot_chain(s) for s in order])),))
    client_key = {"concat": [_SADDR, *_IDENTITY]}
    checks = [
        _rule({"match": {"op": "==", "left": client_key, "right": f"@{affinity_set(s)}"}},
              {"goto": {"target": sticky_chain(s, timeout)}})
        for s in order
    ]
    pick = _rule(_numgen_vmap([sticky_chain(s, timeout) for s in order]))
    return Shared("chain", {}, (*checks, _JUMP_CONSISTENT, pick) if chash else (*checks, pick))


_JUMP_CONSISTENT = _rule({"jump": {"target": CONSISTENT_CHAIN}})


@functools.lru_cache(maxsize=4096)
def _slot(slot: int, snat: Snat | None) -> dict[str, Shared]:
    identity = {"concat": _IDENTITY}
    rules = []
    if snat is not None and snat.hairpin is not None:
        rules.append(_rule({"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": snat.interface}},
                           {"mangle": {"key": _MARK, "value": {"|": [_MARK, snat.hairpin]}}}))
    if snat is not None and snat.masquerade is not None:
        rules.append(_rule({"mangle": {"key": _CT_MARK, "value": {"|": [_CT_MARK, snat.masquerade]}}}))
    rules.append(_rule({"dnat": {"family": "ip", "addr": {"map": {"key": identity, "data": f"@{backend_map(slot)}"}}}}))
    return {
        backend_map(slot): Shared("set", {"type": IDENTITY_TYPE, "map": BACKEND_DATA, "stmt": [{"counter": None}]}),
        slot_chain(slot): Shared("chain", {}, tuple(rules)),
    }


@functools.lru_cache(maxsize=4096)
def _sticky(slot: int, timeout: int, size: int) -> dict[str, Shared]:
    client_key = {"concat": [_SADDR, *_IDENTITY]}
    return {
        affinity_set(slot): Shared("set", {"type": ["ipv4_addr", *IDENTITY_TYPE], "flags": ["timeout"], "size": size}),
        sticky_chain(slot, timeout): Shared("chain", {}, (
            _rule({"set": {"op": "update", "elem": {"elem": {"val": client_key, "timeout": timeout}},
                           "set": f"@{affinity_set(slot)}"}}),
            _rule({"goto": {"target": slot_chain(slot)}}),
        )),
    }
