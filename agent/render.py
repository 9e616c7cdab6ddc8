"""Desired services -> the table's content (a Ruleset). Pure: no I/O.

Layout (why: REFERENCE section 5 -- the kernel finds sets by walking a per-table list, so
thousands of named or anonymous sets cost quadratic time; chains and map elements are
cheap). Everything per identity is a map element; chains and sets are shared:

    prerouting      ip daddr . meta l4proto . th dport vmap @services
    map services    identity -> goto lb_<slots> | aff_t<T>_<slots>
    lb_<slots>      numgen random mod N vmap { i : goto slot_<s_i> }
    slot_<s>        dnat to <identity> map @addr_<s> : <identity> map @port_<s>
    map addr_<s>    identity -> backend address (with a per-backend counter)
    map port_<s>    identity -> backend port

Each backend of an identity holds one *slot* for its whole life, so its map elements and
its clients' affinity entries stay put while other backends come and go. ClientIP:

    aff_t<T>_<slots>  ip saddr . <identity> @aff_<s> goto sticky_<s>_t<T>   (one per slot)
                      numgen random mod N vmap { i : goto sticky_<s_i>_t<T> }
    sticky_<s>_t<T>   update @aff_<s> { ip saddr . <identity> timeout T }  (slides per connection)
                      goto slot_<s>
    set aff_<s>       client . identity, flags timeout: the clients pinned to slot s

The update and the goto are two rules so that a full affinity set costs stickiness, never
the connection.
"""
from __future__ import annotations

import hashlib
import itertools
import re
from typing import Any, Mapping

from agent.desired import Service
from agent.model import Backend, Identity
from agent.ruleset import Elem, Key, Ruleset, truncate_comment

SERVICES = "services"
BASE_CHAIN = "prerouting"
IDENTITY_TYPE = ["ipv4_addr", "inet_proto", "inet_service"]

_DADDR = {"payload": {"protocol": "ip", "field": "daddr"}}
_SADDR = {"payload": {"protocol": "ip", "field": "saddr"}}
_IDENTITY = [_DADDR, {"meta": {"key": "l4proto"}}, {"payload": {"protocol": "th", "field": "dport"}}]
_PATTERN_RE = re.compile(r"^(?:lb|aff_t(?P<timeout>\d+))_(?:n\d+|s[\d.]+|h[0-9a-f]+)$")

Slots = dict[Identity, dict[Backend, int]]


def addr_map(slot: int) -> str:
    return f"addr_{slot}"


def port_map(slot: int) -> str:
    return f"port_{slot}"


def affinity_set(slot: int) -> str:
    return f"aff_{slot}"


def slot_chain(slot: int) -> str:
    return f"slot_{slot}"


def sticky_chain(slot: int, timeout: int) -> str:
    return f"sticky_{slot}_t{timeout}"


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
        before = previous.get(identity, {})
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
        if not name.startswith("addr_"):
            continue
        slot = int(name.removeprefix("addr_"))
        ports = ruleset.elements.get(port_map(slot), {})
        for key, elem in elements.items():
            if key in ports:
                slots.setdefault(key_identity(key), {})[Backend(elem.value, int(ports[key].value))] = slot
    return slots


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


def render(services: Mapping[Identity, Service], previous: Ruleset, affinity_set_size: int, priority: int) -> Ruleset:
    """The whole table for these services; slots follow `previous` (the kernel's state)."""
    slots = assign_slots(services, slots_of(previous))
    rs = Ruleset()
    rs.sets[SERVICES] = {"type": IDENTITY_TYPE, "map": "verdict"}
    rs.chains[BASE_CHAIN] = {"type": "nat", "hook": "prerouting", "prio": priority, "policy": "accept"}
    rs.rules[BASE_CHAIN] = (_rule({"vmap": {"key": {"concat": _IDENTITY}, "data": f"@{SERVICES}"}}),)
    rs.elements[SERVICES] = {}
    for identity, service in sorted(services.items()):
        held = slots[identity]
        order = tuple(sorted(held.values()))
        timeout = service.timeout if service.affinity else None
        key = identity_key(identity)
        target = pattern_chain(order, timeout)
        rs.elements[SERVICES][key] = Elem({"goto": {"target": target}}, truncate_comment(service.rule_names))
        if target not in rs.chains:
            _add_pattern(rs, target, order, timeout)
        for backend, slot in held.items():
            if slot_chain(slot) not in rs.chains:
                _add_slot(rs, slot)
            rs.elements[addr_map(slot)][key] = Elem(backend.ip, truncate_comment(service.rules[backend]))
            rs.elements[port_map(slot)][key] = Elem(backend.port)
            if timeout is not None:
                _add_sticky(rs, slot, timeout, affinity_set_size)
    return rs


def _rule(*expr: Any) -> dict[str, Any]:
    return {"expr": list(expr)}


def _numgen_vmap(targets: list[str]) -> dict[str, Any]:
    return {
        "vmap": {
            "key": {"numgen": {"mode": "random", "mod": len(targets), "offset": 0}},
            "data": {"set": [[i, {"goto": {"target": t}}] for i, t in enumerate(targets)]},
        }
    }


def _add_pattern(rs: Ruleset, name: str, order: tuple[int, ...], timeout: int | None) -> None:
    rs.chains[name] = {}
    if timeout is None:
        rs.rules[name] = (_rule(_numgen_vmap([slot_chain(s) for s in order])),)
        return
    client_key = {"concat": [_SADDR, *_IDENTITY]}
    checks = [
        _rule({"match": {"op": "==", "left": client_key, "right": f"@{affinity_set(s)}"}},
              {"goto": {"target": sticky_chain(s, timeout)}})
        for s in order
    ]
    rs.rules[name] = (*checks, _rule(_numgen_vmap([sticky_chain(s, timeout) for s in order])))


def _add_slot(rs: Ruleset, slot: int) -> None:
    rs.sets[addr_map(slot)] = {"type": IDENTITY_TYPE, "map": "ipv4_addr", "stmt": [{"counter": None}]}
    rs.sets[port_map(slot)] = {"type": IDENTITY_TYPE, "map": "inet_service"}
    rs.elements[addr_map(slot)] = {}
    rs.elements[port_map(slot)] = {}
    identity = {"concat": _IDENTITY}
    rs.chains[slot_chain(slot)] = {}
    rs.rules[slot_chain(slot)] = (
        _rule({"dnat": {"addr": {"map": {"key": identity, "data": f"@{addr_map(slot)}"}},
                        "port": {"map": {"key": identity, "data": f"@{port_map(slot)}"}}}}),
    )


def _add_sticky(rs: Ruleset, slot: int, timeout: int, size: int) -> None:
    name = sticky_chain(slot, timeout)
    if name in rs.chains:
        return
    rs.sets.setdefault(affinity_set(slot), {"type": ["ipv4_addr", *IDENTITY_TYPE], "flags": ["timeout"], "size": size})
    rs.chains[name] = {}
    client_key = {"concat": [_SADDR, *_IDENTITY]}
    rs.rules[name] = (
        _rule({"set": {"op": "update", "elem": {"elem": {"val": client_key, "timeout": timeout}},
                       "set": f"@{affinity_set(slot)}"}}),
        _rule({"goto": {"target": slot_chain(slot)}}),
    )
