"""The table's layout: the names of its objects, and reading them back. Pure: no I/O.

Why this shape (measured here: 8,000 named sets in one table 1.07 s, 32,000 in 29.7 s; the kernel finds sets by walking a per-table list,
so thousands of named or anonymous sets cost quadratic time; chains and map elements are
cheap): everything per identity is a map element; chains and sets are shared.

    prerouting      ip daddr . meta l4proto . th dport vmap @services
    map services    identity -> goto lb_<slots> | aff_t<T>_<slots>
    lb_<slots>      numgen random mod N vmap { i : goto slot_<s_i> }
    slot_<s>        dnat to <identity> map @backend_<s>
    map backend_<s> identity -> backend address . port (with a per-backend counter)
    postrouting     oifname <vpc> meta mark & M == M snat to ct original ip daddr   (hairpin only;
                    slot_<s> then first marks packets from iifname <vpc> with M)
                    oifname <vpc> ct mark & C == C masquerade   (masquerade only; slot_<s>
                    then first sets C in the connection's mark: only the agent's flows)

Each backend of an identity holds one *slot* for its whole life, so its map elements and
its clients' affinity entries stay put while other backends come and go. ClientIP:

    aff_t<T>_<slots>  ip saddr . <identity> @aff_<s> goto sticky_<s>_t<T>   (one per slot)
                      jump consistent
                      numgen random mod N vmap { i : goto sticky_<s_i>_t<T> }
    consistent        jhash ip saddr mod 61 seed S vmap { b : goto bucket_<b> }
    bucket_<b>        <identity> vmap @chash_<b>
    map chash_<b>     identity -> goto sticky_<s>_t<T>: the slot of bucket b's backend
    sticky_<s>_t<T>   update @aff_<s> { ip saddr . <identity> timeout T }  (slides per connection)
                      goto slot_<s>
    set aff_<s>       client . identity, flags timeout: the clients pinned to slot s

A client with no pin takes the bucket its address hashes to, and the chash maps hold, per
identity, the backend of each bucket: agent/core/consistent.py's table, a function of the
backends alone, so every replica of a gateway makes the same first choice whatever its
slots or history (issue 21). A NAT statement is terminal (it accepts), so the numgen
rule after the jump serves only while an identity's buckets are not (yet) in the kernel.
Their cost beyond elements: the kernel validates a table's jump graph, verdict maps'
elements included, at the commit of any transaction that adds a jump or a verdict element
(measured here: 610,000 reachable verdict elements, ~60 ms a transaction; 0.35 ms while
none is reachable), so at 10,000 ClientIP identities every change pays ~60 ms.
One map per bucket, not one keyed `identity . bucket`: the kernel dumps a hash map in
parts, walking it from its start for each (measured here: 122,000 elements in one map
0.54 s, 305,000 in 2.92 s, in 61 maps 0.25 s and 0.69 s); and libnftables reads every
element of a map a new rule names (a rule naming a 610,000-element map: 131 ms), which
no pattern chain does here. In the Ruleset the 61 maps are one entry, CHASH, holding a
Buckets per identity (ruleset.Buckets).

One `address . port` map per slot, not one map for each: elements are what a full sync
pays for (libnftables spends ~10 us on each), and this nearly halves them (10,000
identities x 4: 90,000 -> 50,000 elements, libnftables alone 631 -> 480 ms).

A change to this layout touches this module and render.py only."""
from __future__ import annotations

import functools
import hashlib
import re
from typing import Any, Iterable, Iterator, Mapping

from agent.core.model import Backend, Identity
from agent.core.ruleset import Buckets, Elem, ElemKey, Ruleset, bucket_map

SERVICES = "services"
BASE_CHAIN = "prerouting"
SNAT_CHAIN = "postrouting"  # only with the agent's own hairpin SNAT or masquerade (render.Snat)
IDENTITY_TYPE = ["ipv4_addr", "inet_proto", "inet_service"]
# The backend maps' data type exactly as nft 1.0.6 lists it: a string, which its JSON
# parser does not take back (the planner has such maps declared in nft text).
BACKEND_DATA = "ipv4_addr . inet_service"
CHASH = "chash"  # the elements of the maps chash_<b>, one Buckets per identity
CONSISTENT_CHAIN = "consistent"
# Bucket maps read back at or beyond this are not the agent's (it writes < consistent.SIZE):
# left out of the fold, so no stray map can make it build a list of 4 billion entries.
_BUCKET_LIMIT = 4096

_PATTERN_RE = re.compile(r"^(?:lb|aff_t(?P<timeout>\d+))_(?:n\d+|s[\d.]+|h[0-9a-f]+)$")

Slots = dict[Identity, dict[Backend, int]]
Counters = dict[tuple[str, str], tuple[int, int]]  # (identity, backend) as text -> (packets, bytes)


@functools.lru_cache(maxsize=1024)
def backend_map(slot: int) -> str:
    return f"backend_{slot}"


def chash_map(bucket: int) -> str:
    return bucket_map(CHASH, bucket)


def affinity_set(slot: int) -> str:
    return f"aff_{slot}"


def slot_chain(slot: int) -> str:
    return f"slot_{slot}"


def sticky_chain(slot: int, timeout: int) -> str:
    return f"sticky_{slot}_t{timeout}"


_STICKY_RE = re.compile(r"^sticky_(\d+)_t\d+$")


def sticky_slot(chain: str) -> int | None:
    """The slot a sticky chain's name names; None for any other chain."""
    m = _STICKY_RE.match(chain)
    return int(m[1]) if m else None


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


def goto_target(elem: Elem) -> str:
    """The chain a services element jumps to ("" if it is not a goto)."""
    value = elem.value
    return value.get("goto", {}).get("target", "") if isinstance(value, dict) else ""


def identity_key(identity: Identity) -> ElemKey:
    return (identity.eip, identity.proto, identity.port)


def key_identity(key: ElemKey) -> Identity:
    eip, proto, port = key
    return Identity(eip, int(port), proto)


def backend_slot(name: str) -> int | None:
    """The slot of a backend map's name; None for any other object."""
    return _numbered(name, "backend_")


def affinity_slot(name: str) -> int | None:
    """The slot of an affinity set's name; None for any other object."""
    return _numbered(name, "aff_")


def _numbered(name: str, prefix: str) -> int | None:
    tail = name.removeprefix(prefix)
    return int(tail) if tail != name and tail.isdigit() else None


def backend_of(elem: Elem) -> Backend | None:
    """The backend in a backend map element; None for anything else (a read-back of a
    table someone altered), which the next plan then replaces."""
    value = elem.value
    if type(value) is Backend:
        return value
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int):
        return Backend(value[0], value[1])
    return None


def bucket_chain(bucket: int) -> str:
    return f"bucket_{bucket}"


def chash_bucket(name: str) -> int | None:
    """The bucket of a chash map's name; None for any other object."""
    b = _numbered(name, f"{CHASH}_")
    return b if b is not None and b < _BUCKET_LIMIT else None


def elements_under(name: str) -> str:
    """Where a map's elements are kept in a Ruleset: a chash map's under CHASH."""
    return CHASH if chash_bucket(name) is not None else name


def fold_buckets(by_map: Mapping[str, Mapping[ElemKey, Elem]]) -> dict[ElemKey, Buckets]:
    """The chash maps' kernel elements (map chash_<b>: identity -> verdict) as one Buckets
    per identity, the form render.py writes."""
    grouped: dict[ElemKey, list[Any]] = {}
    for name, elements in by_map.items():
        b = chash_bucket(name)
        if b is None:
            continue
        for key, elem in elements.items():
            verdicts = grouped.setdefault(key, [])
            if b >= len(verdicts):
                verdicts.extend([None] * (b + 1 - len(verdicts)))
            verdicts[b] = elem.value
    return {identity: Buckets(verdicts) for identity, verdicts in grouped.items()}


def in_render_form(rs: Ruleset) -> Ruleset:
    """A table as read back (a map per bucket), with the chash maps folded under CHASH."""
    maps = [n for n in rs.elements if chash_bucket(n) is not None]
    if not maps:
        return rs
    elements = {n: e for n, e in rs.elements.items() if chash_bucket(n) is None}
    elements[CHASH] = fold_buckets({n: rs.elements[n] for n in maps})
    return Ruleset(rs.sets, rs.chains, rs.rules, elements)


def slots_of(ruleset: Ruleset) -> Slots:
    """Which slot each backend holds, read from a ruleset (rendered or read back)."""
    slots: Slots = {}
    for name, elements in ruleset.elements.items():
        if (slot := backend_slot(name)) is None:
            continue
        for key, elem in elements.items():
            if (backend := backend_of(elem)) is not None:
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


def held_slots(elements: Mapping[str, Elem]) -> dict[Backend, int]:
    """Which slot each backend of one identity holds, from its elements (map -> element)."""
    return {b: s for name, elem in elements.items()
            if (s := backend_slot(name)) is not None and (b := backend_of(elem)) is not None}


def sticky_slots(ruleset: Ruleset) -> dict[Identity, dict[int, Backend]]:
    """For each ClientIP identity, its slots and the backend in each."""
    sticky = {
        key_identity(key)
        for key, elem in ruleset.elements.get(SERVICES, {}).items()
        if (target := parse_target(goto_target(elem))) is not None and target[0]
    }
    return {
        identity: {slot: backend for backend, slot in held.items()}
        for identity, held in slots_of(ruleset).items()
        if identity in sticky
    }


def served(ruleset: Ruleset) -> Iterator[tuple[Identity, Elem]]:
    """Every identity of a ruleset with its services element, in identity order."""
    for key, elem in sorted(ruleset.elements.get(SERVICES, {}).items(), key=lambda kv: key_identity(kv[0])):
        yield key_identity(key), elem


def backend_counters(elements: Mapping[str, Mapping[ElemKey, Elem]],
                     counters: Mapping[str, Mapping[ElemKey, tuple[int, int]]]) -> Counters:
    """{("eip:port/proto", "ip:port"): (packets, bytes)} from the backend maps' elements
    and their per-element counters."""
    result: Counters = {}
    for name, by_key in counters.items():
        if backend_slot(name) is None:
            continue
        held = elements.get(name, {})
        for key, counter in by_key.items():
            elem = held.get(key)
            backend = backend_of(elem) if elem is not None else None
            if backend is not None and len(key) == 3:
                result[(str(key_identity(key)), str(backend))] = counter
    return result


def pinned_clients(entries: Mapping[str, Iterable[ElemKey]]) -> dict[tuple[Identity, int], int]:
    """Live affinity entries per (identity, slot), from each affinity set's entry keys
    (client . identity)."""
    pinned: dict[tuple[Identity, int], int] = {}
    for name, keys in entries.items():
        if (slot := affinity_slot(name)) is None:
            continue
        for key in keys:
            if len(key) == 4:
                at = (key_identity(tuple(key[1:])), slot)
                pinned[at] = pinned.get(at, 0) + 1
    return pinned

