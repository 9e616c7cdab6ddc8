"""Desired services -> the table's content (a Ruleset). Pure: no I/O.

Layout (why: REFERENCE section 5 -- the kernel finds sets by walking a per-table list, so
thousands of named or anonymous sets cost quadratic time; chains and map elements are
cheap). Everything per identity is a map element; chains and sets are shared:

    prerouting      ip daddr . meta l4proto . th dport vmap @services
    map services    identity -> goto lb_<slots> | aff_t<T>_<slots>
    lb_<slots>      numgen random mod N vmap { i : goto slot_<s_i> }
    slot_<s>        dnat to <identity> map @backend_<s>
    map backend_<s> identity -> backend address . port (with a per-backend counter)

Each backend of an identity holds one *slot* for its whole life, so its map elements and
its clients' affinity entries stay put while other backends come and go. ClientIP:

    aff_t<T>_<slots>  ip saddr . <identity> @aff_<s> goto sticky_<s>_t<T>   (one per slot)
                      numgen random mod N vmap { i : goto sticky_<s_i>_t<T> }
    sticky_<s>_t<T>   update @aff_<s> { ip saddr . <identity> timeout T }  (slides per connection)
                      goto slot_<s>
    set aff_<s>       client . identity, flags timeout: the clients pinned to slot s

The update and the goto are two rules so that a full affinity set costs stickiness, never
the connection.

One `address . port` map per slot, not one map for each: elements are what a full sync
pays for (libnftables spends ~10 us on each), and this nearly halves them (10,000
identities x 4: 90,000 -> 50,000 elements, libnftables alone 631 -> 480 ms).
nft 1.0.6 cannot declare such a map in JSON (nft.py declares it; see BACKEND_DATA).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from agent.desired import Service
from agent.model import Backend, Identity
from agent.ruleset import Elem, Key, Ruleset, truncate_comment

SERVICES = "services"
BASE_CHAIN = "prerouting"
IDENTITY_TYPE = ["ipv4_addr", "inet_proto", "inet_service"]
# The backend maps' data type exactly as nft 1.0.6 lists it: a string, which its JSON
# parser does not take back (nft.py declares these maps in its own words).
BACKEND_DATA = "ipv4_addr . inet_service"

_DADDR = {"payload": {"protocol": "ip", "field": "daddr"}}
_SADDR = {"payload": {"protocol": "ip", "field": "saddr"}}
_IDENTITY = [_DADDR, {"meta": {"key": "l4proto"}}, {"payload": {"protocol": "th", "field": "dport"}}]
_PATTERN_RE = re.compile(r"^(?:lb|aff_t(?P<timeout>\d+))_(?:n\d+|s[\d.]+|h[0-9a-f]+)$")

Slots = dict[Identity, dict[Backend, int]]


@functools.lru_cache(maxsize=1024)
def backend_map(slot: int) -> str:
    return f"backend_{slot}"


def affinity_set(slot: int) -> str:
    return f"aff_{slot}"


def slot_chain(slot: int) -> str:
    return f"slot_{slot}"


def sticky_chain(slot: int, timeout: int) -> str:
    return f"sticky_{slot}_t{timeout}"


@functools.lru_cache(maxsize=4096)
def pattern_chain(slots: tuple[int, ...], timeout: int | None) -> str:
    """Chain shared by every identity whose backends hold exactly these slots."""
    if slots == tuple(range(len(slots))):
        tag = f"n{len(slots)}"
    else:
        tag = "s" + ".".join(map(str, slots))
        if len(tag) > 200:  # chain names stop at 256 bytes
            tag = "h" + hashlib.sha1(tag.encode()).hexdigest()[:16]
    return f"lb_{tag}" if timeout is None else f"aff_t{timeout}_{tag}"


def parse_target(chain: str) -> tuple[bool, int] | None:
    """(affinity, timeout) from a services element's target chain, None if not ours."""
    m = _PATTERN_RE.match(chain)
    if m is None:
        return None
    return (m["timeout"] is not None, int(m["timeout"] or 0))


def identity_key(identity: Identity) -> Key:
    return (identity.eip, identity.proto, identity.port)


def key_identity(key: Key) -> Identity:
    eip, proto, port = key
    return Identity(eip, int(port), proto)


def assign_slots(services: Mapping[Identity, Service], previous: Slots) -> Slots:
    """Keep every surviving backend in its slot; give new ones the lowest free slots."""
    result: Slots = {}
    for identity, service in services.items():
        before = previous.get(identity)
        if not before:  # a new identity (every one, on a start from an empty table)
            result[identity] = dict(zip(service.backends, range(len(service.backends))))
            continue
        kept = {b: s for b, s in before.items() if b in service.backends}
        free = (s for s in itertools.count() if s not in kept.values())
        for backend in service.backends:
            if backend not in kept:
                kept[backend] = next(free)
        result[identity] = kept
    return result


def slots_of(ruleset: Ruleset) -> Slots:
    """Which slot each backend holds, read from a ruleset (rendered or read back)."""
    slots: Slots = {}
    for name, elements in ruleset.elements.items():
        if (slot := _backend_slot(name)) is None:
            continue
        for key, elem in elements.items():
            if (backend := _backend(elem)) is not None:
                slots.setdefault(key_identity(key), {})[backend] = slot
    for identity, held in _earlier_layout_slots(ruleset).items():
        slots.setdefault(identity, held)
    return slots


def _earlier_layout_slots(ruleset: Ruleset) -> Slots:
    """Slots as an earlier version held them (an addr_<s> and a port_<s> map per slot),
    so that upgrading keeps every backend in its slot and so its clients' affinity."""
    slots: Slots = {}
    for name, addresses in ruleset.elements.items():
        tail = name.removeprefix("addr_")
        ports = ruleset.elements.get(f"port_{tail}") if tail != name and tail.isdigit() else None
        for key, elem in addresses.items() if ports else ():
            port = ports.get(key)
            if isinstance(elem.value, str) and port is not None and isinstance(port.value, int):
                slots.setdefault(key_identity(key), {})[Backend(elem.value, port.value)] = int(tail)
    return slots


def held_slots(pieces: Pieces) -> dict[Backend, int]:
    """Which slot each backend of one identity holds, from its rendered pieces."""
    return {b: s for name, elem in pieces.elements.items()
            if (s := _backend_slot(name)) is not None and (b := _backend(elem)) is not None}


def _backend_slot(name: str) -> int | None:
    tail = name.removeprefix("backend_")
    return int(tail) if tail != name and tail.isdigit() else None


def _backend(elem: Elem) -> Backend | None:
    """The backend in a backend map element; None for anything else (a read-back of a
    table someone altered), which the next plan then replaces."""
    value = elem.value
    pair = value.get("concat") if isinstance(value, dict) else None
    if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], int):
        return Backend(pair[0], pair[1])
    return None


def sticky_slots(ruleset: Ruleset) -> dict[Identity, dict[int, Backend]]:
    """For each ClientIP identity, its slots and the backend in each."""
    sticky = {
        key_identity(key)
        for key, elem in ruleset.elements.get(SERVICES, {}).items()
        if (target := parse_target(_goto(elem))) is not None and target[0]
    }
    return {
        identity: {slot: backend for backend, slot in held.items()}
        for identity, held in slots_of(ruleset).items()
        if identity in sticky
    }


def _goto(elem: Elem) -> str:
    value = elem.value
    return value.get("goto", {}).get("target", "") if isinstance(value, dict) else ""


@dataclass(frozen=True)
class Shared:
    """A chain, set or map that identities share: declared while any of them needs it."""

    kind: str  # "chain" or "set" (a map is a set whose declaration has "map")
    decl: dict[str, Any]
    rules: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Pieces:
    """What one identity puts into the table: one element (under its key) in each of
    some maps, and the shared objects those elements lead to."""

    key: Key
    elements: dict[str, Elem]  # map name -> this identity's element
    shared: Mapping[str, Shared]  # the same (read-only) mapping for every identity of a pattern


def render(services: Mapping[Identity, Service], previous: Ruleset, affinity_set_size: int, priority: int) -> Ruleset:
    """The whole table for these services; slots follow `previous` (the kernel's state)."""
    return render_all(services, previous, affinity_set_size, priority)[0]


def render_all(services: Mapping[Identity, Service], previous: Ruleset, affinity_set_size: int,
               priority: int) -> tuple[Ruleset, dict[Identity, Pieces]]:
    """The whole table, and each identity's pieces of it."""
    slots = assign_slots(services, slots_of(previous))
    pieces = {i: render_service(s, slots[i], affinity_set_size) for i, s in sorted(services.items())}
    rs = base_ruleset(priority)
    declared: set[int] = set()  # ids of the shared mappings declared so far
    for p in pieces.values():
        add_pieces(rs, p, id(p.shared) not in declared)
        declared.add(id(p.shared))
    return rs, pieces


def base_ruleset(priority: int) -> Ruleset:
    """The table with no identity: the base chain and its dispatch map."""
    rs = Ruleset()
    rs.sets[SERVICES] = {"type": IDENTITY_TYPE, "map": "verdict"}
    rs.chains[BASE_CHAIN] = {"type": "nat", "hook": "prerouting", "prio": priority, "policy": "accept"}
    rs.rules[BASE_CHAIN] = (_rule({"vmap": {"key": {"concat": _IDENTITY}, "data": f"@{SERVICES}"}}),)
    rs.elements[SERVICES] = {}
    return rs


def add_pieces(rs: Ruleset, pieces: Pieces, shared: bool = True) -> None:
    if shared:
        for name, definition in pieces.shared.items():
            declare(rs, name, definition)
    for name, elem in pieces.elements.items():
        rs.elements[name][pieces.key] = elem


def declare(rs: Ruleset, name: str, shared: Shared) -> None:
    if shared.kind == "chain":
        rs.chains[name] = shared.decl
        rs.rules[name] = shared.rules
    else:
        rs.sets[name] = shared.decl
        if "map" in shared.decl:
            rs.elements.setdefault(name, {})


def undeclare(rs: Ruleset, name: str) -> None:
    for table in (rs.chains, rs.rules, rs.sets, rs.elements):
        table.pop(name, None)


def render_service(service: Service, held: Mapping[Backend, int], affinity_set_size: int) -> Pieces:
    """One identity's elements and the shared objects they need, its backends in `held` slots."""
    key = identity_key(service.identity)
    order = tuple(sorted(held.values()))
    timeout = service.timeout if service.affinity else None
    target = pattern_chain(order, timeout)
    elements = {SERVICES: Elem({"goto": {"target": target}}, truncate_comment(service.rule_names))}
    for backend, slot in held.items():
        elements[backend_map(slot)] = Elem({"concat": [backend.ip, backend.port]})
    return Pieces(key, elements, _shared(order, timeout, affinity_set_size))


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
def _shared(order: tuple[int, ...], timeout: int | None, size: int) -> Mapping[str, Shared]:
    """Everything an identity with backends in these slots needs declared (read-only: one
    mapping serves every identity of the pattern)."""
    shared = {pattern_chain(order, timeout): _pattern(order, timeout)}
    for slot in order:
        shared.update(_slot(slot))
        if timeout is not None:
            shared.update(_sticky(slot, timeout, size))
    return MappingProxyType(shared)


@functools.lru_cache(maxsize=4096)
def _pattern(order: tuple[int, ...], timeout: int | None) -> Shared:
    if timeout is None:
        return Shared("chain", {}, (_rule(_numgen_vmap([slot_chain(s) for s in order])),))
    client_key = {"concat": [_SADDR, *_IDENTITY]}
    checks = [
        _rule({"match": {"op": "==", "left": client_key, "right": f"@{affinity_set(s)}"}},
              {"goto": {"target": sticky_chain(s, timeout)}})
        for s in order
    ]
    return Shared("chain", {}, (*checks, _rule(_numgen_vmap([sticky_chain(s, timeout) for s in order]))))


@functools.lru_cache(maxsize=4096)
def _slot(slot: int) -> dict[str, Shared]:
    identity = {"concat": _IDENTITY}
    return {
        backend_map(slot): Shared("set", {"type": IDENTITY_TYPE, "map": BACKEND_DATA, "stmt": [{"counter": None}]}),
        slot_chain(slot): Shared("chain", {}, (
            _rule({"dnat": {"family": "ip", "addr": {"map": {"key": identity, "data": f"@{backend_map(slot)}"}}}}),
        )),
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
