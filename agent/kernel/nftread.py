"""One nf_tables table read over the agent's own netlink (agent/kernel/nfnetlink.py), decoded
into the agent's canonical forms: exactly what agent/core/render.py renders and what
agent/core/ruleset.py from_listing() parses from nft 1.0.6's `nft -j list table`.

Why not libnftables' listing (REFERENCE section 7): its JSON differs across nftables
versions, and it restarts its whole-ruleset dump whenever the generation moves, so with
another table committing every 100 ms a large table never lists. Here only this table's
objects are dumped (all messages first, decoded after: the dumps take ~40 ms at 50,000
elements), and a pass is kept when this table did not change during it: either the
generation did not move, or the notifications of the commits meanwhile (subscribed
before the first dump) name no object of this table. Otherwise it reads again, a bounded
number of times. NLM_F_DUMP_INTR alone could not tell: the kernel (6.18) flags chain,
rule and set dumps but never an element dump, and flags another table's commit too.

What the kernel filters (verified on 6.18): set and rule dumps by table, element dumps
by set; chain dumps only by family (every table's chains come), so chains are filtered
here.

Decoding is by meaning: registers are tracked (NFT_REG_1..4 are 16-byte registers
aliasing NFT_REG32_00.. = 8..23; a concatenation fills consecutive 32-bit registers, each
component rounded up to 4 bytes) and each statement is rebuilt in nft's JSON vocabulary.
An expression sequence outside that vocabulary becomes an opaque marker rule
({"expr": [{"opaque": "..."}]}) that never equals a rendered rule; nothing here raises
on what the kernel (or a corrupt recording) sends. The forms nft >= 1.0.9 or 1.1.x list
differently (the `dynamic` flag of sets filled by `update`, a concatenated map type as a
list) come out in the 1.0.6 form, which is what render.py writes.

Set and element decoding is one code path for dumps and for notifications (`Decoder`)."""
from __future__ import annotations

import errno as errnos
import gc
import socket as _socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from agent.kernel import nfnetlink as nl
from agent.kernel.nfnetlink import MalformedError, Message, NetlinkError, NfSocket, Subscriber
from agent.core.ruleset import Elem, ElemKey, Ruleset, data_json, element, goto

FAMILIES = {"unspec": 0, "inet": 1, "ip": 2, "arp": 3, "netdev": 5, "bridge": 7, "ip6": 10}
FAMILY_NAMES = {v: k for k, v in FAMILIES.items()}

# nf_tables message types (linux/netfilter/nf_tables.h)
NEWTABLE, GETTABLE, DELTABLE = 0, 1, 2
NEWCHAIN, GETCHAIN, DELCHAIN = 3, 4, 5
NEWRULE, GETRULE, DELRULE = 6, 7, 8
NEWSET, GETSET, DELSET = 9, 10, 11
NEWSETELEM, GETSETELEM, DELSETELEM = 12, 13, 14
NEWGEN, GETGEN = 15, 16
NEWOBJ, DELOBJ = 18, 20
NEWFLOWTABLE, DELFLOWTABLE = 22, 24
_KINDS = {NEWTABLE: ("table", "new"), DELTABLE: ("table", "del"), NEWCHAIN: ("chain", "new"),
          DELCHAIN: ("chain", "del"), NEWRULE: ("rule", "new"), DELRULE: ("rule", "del"),
          NEWSET: ("set", "new"), DELSET: ("set", "del"), NEWSETELEM: ("element", "new"),
          DELSETELEM: ("element", "del"), NEWGEN: ("gen", "new"), NEWOBJ: ("object", "new"),
          DELOBJ: ("object", "del"), NEWFLOWTABLE: ("flowtable", "new"), DELFLOWTABLE: ("flowtable", "del")}

# attributes
TABLE_NAME, TABLE_FLAGS, TABLE_HANDLE = 1, 2, 4
CHAIN_TABLE, CHAIN_HANDLE, CHAIN_NAME, CHAIN_HOOK, CHAIN_POLICY, CHAIN_TYPE, CHAIN_FLAGS = 1, 2, 3, 4, 5, 7, 10
HOOK_HOOKNUM, HOOK_PRIORITY = 1, 2
RULE_TABLE, RULE_CHAIN, RULE_HANDLE, RULE_EXPRESSIONS, RULE_USERDATA = 1, 2, 3, 4, 7
SET_TABLE, SET_NAME, SET_FLAGS, SET_KEY_TYPE, SET_KEY_LEN, SET_DATA_TYPE, SET_DATA_LEN = 1, 2, 3, 4, 5, 6, 7
SET_POLICY, SET_DESC, SET_TIMEOUT, SET_USERDATA, SET_OBJ_TYPE, SET_HANDLE, SET_EXPR, SET_EXPRESSIONS = \
    8, 9, 11, 13, 15, 16, 17, 18
SET_DESC_SIZE, SET_DESC_CONCAT, SET_FIELD_LEN = 1, 2, 1
ELIST_TABLE, ELIST_SET, ELIST_ELEMENTS = 1, 2, 3
ELEM_KEY, ELEM_DATA, ELEM_FLAGS, ELEM_TIMEOUT, ELEM_EXPIRATION, ELEM_USERDATA = 1, 2, 3, 4, 5, 6
ELEM_EXPR, ELEM_OBJREF, ELEM_KEY_END, ELEM_EXPRESSIONS = 7, 9, 10, 11
LIST_ELEM = 1
DATA_VALUE, DATA_VERDICT = 1, 2
VERDICT_CODE, VERDICT_CHAIN = 1, 2
EXPR_NAME, EXPR_DATA = 1, 2
GEN_ID, GEN_PROC_PID, GEN_PROC_NAME = 1, 2, 3
COUNTER_BYTES, COUNTER_PACKETS = 1, 2

# flags
SET_ANONYMOUS, SET_CONSTANT, SET_INTERVAL, SET_MAP, SET_TIMEOUT, SET_EVAL, SET_OBJECT = \
    0x1, 0x2, 0x4, 0x8, 0x10, 0x20, 0x40
ELEM_INTERVAL_END, ELEM_CATCHALL = 0x1, 0x2
_RANGE = 0x100  # (ours) the element had NFTA_SET_ELEM_KEY_END: a range, not decoded
CHAIN_BINDING = 0x4
DATA_VERDICT_TYPE = 0xFFFFFF00
UDATA_SET_KEYBYTEORDER, UDATA_SET_DATABYTEORDER = 0, 1
UDATA_ELEM_COMMENT = 0
UDATA_RULE_COMMENT = 0
BYTEORDER_HOST = 1

_VERDICTS = {0: "drop", 1: "accept", -1: "continue", -2: "break", -5: "return"}
_CHAIN_VERDICTS = {-3: "jump", -4: "goto"}
_HOOKS = {"ip": ("prerouting", "input", "forward", "output", "postrouting"),
          "ip6": ("prerouting", "input", "forward", "output", "postrouting"),
          "inet": ("prerouting", "input", "forward", "output", "postrouting", "ingress"),
          "bridge": ("prerouting", "input", "forward", "output", "postrouting"),
          "arp": ("input", "output"), "netdev": ("ingress", "egress")}
_OBJ_TYPES = {1: "counter", 2: "quota", 3: "ct helper", 4: "limit", 7: "ct timeout", 8: "secmark",
              9: "ct expectation", 10: "synproxy"}
# /etc/protocols names as nft prints them (getprotobynumber); others print as numbers
_PROTOS = {1: "icmp", 2: "igmp", 6: "tcp", 17: "udp", 33: "dccp", 47: "gre", 50: "esp", 51: "ah",
           132: "sctp", 136: "udplite"}

_BE16, _BE32, _BE64 = struct.Struct("!H"), struct.Struct("!I"), struct.Struct("!Q")
_NLA = struct.Struct("=HH")
_MASK = nl.NLA_TYPE_MASK


# --- data types (nftables' include/datatype.h ids; a concatenation packs them 6 bits each) ---

def _ipv4(b: bytes) -> str:
    return f"{b[0]}.{b[1]}.{b[2]}.{b[3]}"


def _ipv6(b: bytes) -> str:
    return _socket.inet_ntop(_socket.AF_INET6, b)


def _proto(b: bytes) -> Any:
    return _PROTOS.get(b[0], b[0])


def _be_int(b: bytes) -> int:
    return int.from_bytes(b, "big")


def _ether(b: bytes) -> str:
    return ":".join(f"{x:02x}" for x in b)


def _ifname(b: bytes) -> str:
    return nl.get_str(b)


def _host_int(b: bytes) -> int:
    """A mark: nft keeps it in the host's byte order."""
    return int.from_bytes(b, sys.byteorder)


class _Type(NamedTuple):
    name: str
    size: int | None  # bytes; None: the set's key length says
    decode: Callable[[bytes], Any] | None  # None: not decoded with certainty (hex marker)


_TYPES: dict[int, _Type] = {
    1: _Type("verdict", None, None), 2: _Type("nf_proto", 1, None), 3: _Type("bitmask", None, None),
    4: _Type("integer", None, None), 5: _Type("string", None, None), 6: _Type("ll_addr", None, None),
    7: _Type("ipv4_addr", 4, _ipv4), 8: _Type("ipv6_addr", 16, _ipv6), 9: _Type("ether_addr", 6, _ether),
    10: _Type("ether_type", 2, None), 12: _Type("inet_proto", 1, _proto), 13: _Type("inet_service", 2, _be_int),
    19: _Type("mark", 4, _host_int), 41: _Type("ifname", 16, _ifname),
}


def _type(tid: int) -> _Type:
    return _TYPES.get(tid) or _Type(f"type_{tid}", None, None)


def split_concat(type_id: int) -> list[int]:
    """Component datatype ids of a (possibly concatenated) NFTA_SET_KEY_TYPE, first first."""
    if type_id == DATA_VERDICT_TYPE:
        return [1]
    parts = []
    while True:
        parts.append(type_id & 0x3F)
        type_id >>= 6
        if not type_id:
            break
    return parts[::-1]


def _hex(b: bytes) -> str:
    return "0x" + b.hex()


def _int_decoder(host_order: bool) -> Callable[[bytes], Any]:
    order = sys.byteorder if host_order else "big"
    return lambda b: int.from_bytes(b, order)


def _value_decoder(types: list[int], total: int, host_order: bool = False) -> Callable[[bytes], Any]:
    """bytes -> tuple of component values (one per type), for keys and map data. A
    component of a type decoded without certainty becomes a hex string, which never
    equals what the agent renders."""
    if len(types) == 1:
        t = _type(types[0])
        if types[0] == 4:
            dec = _int_decoder(host_order)
        elif t.decode is None or (t.size is not None and t.size != total):
            dec = _hex
        else:
            dec = t.decode
        return lambda b: (dec(b),)
    sizes = [_type(t).size for t in types]
    if None in sizes or sum((s + 3) & ~3 for s in sizes) != total:  # type: ignore[operator]
        return lambda b: (_hex(b),)
    plan = []
    off = 0
    for t, s in zip(types, sizes, strict=True):
        d = _type(t).decode or _hex
        plan.append((off, off + s, d))  # type: ignore[operator]
        off += (s + 3) & ~3  # type: ignore[operator]
    # The agent's own shapes, one struct call each (50,000 elements at 10k x 4):
    if types == [7, 12, 13]:  # identity key: address . protocol . port
        fmt = struct.Struct("!4BB3xH2x")

        def identity(b: bytes) -> ElemKey:
            a0, a1, a2, a3, p, port = fmt.unpack(b)
            return (f"{a0}.{a1}.{a2}.{a3}", _PROTOS.get(p, p), port)
        return identity
    if types == [7, 13]:  # backend data: address . port
        pair = struct.Struct("!4BH2x")

        def backend(b: bytes) -> tuple[Any, ...]:
            a0, a1, a2, a3, port = pair.unpack(b)
            return (f"{a0}.{a1}.{a2}.{a3}", port)
        return backend
    return lambda b: tuple(d(b[x:y]) for x, y, d in plan)


# --- sets -------------------------------------------------------------------------------

@dataclass(frozen=True)
class SetInfo:
    """A set as the kernel declares it, and how to decode its elements."""

    name: str
    table: str
    family: int
    flags: int
    key_types: tuple[int, ...]
    key_len: int
    data_types: tuple[int, ...]  # () for a plain set; (1,) for verdict maps
    data_len: int
    decl: dict[str, Any]  # the canonical declaration (render.py's form)
    handle: int | None = None
    key_host_order: bool = False
    decode_key: Callable[[bytes], ElemKey] = field(default=lambda b: (b,), compare=False, repr=False)
    decode_data: Callable[[bytes], tuple[Any, ...]] | None = field(default=None, compare=False, repr=False)

    @property
    def anonymous(self) -> bool:
        return bool(self.flags & SET_ANONYMOUS)

    @property
    def is_map(self) -> bool:
        return bool(self.flags & SET_MAP)


def _udata(value: bytes) -> dict[int, bytes]:
    """nftnl userdata TLVs: one byte type, one byte length, value."""
    out: dict[int, bytes] = {}
    off = 0
    while off + 2 <= len(value):
        t, n = value[off], value[off + 1]
        if off + 2 + n > len(value):
            break
        out[t] = value[off + 2:off + 2 + n]
        off += 2 + n
    return out


def _stmt_names(buf: bytes) -> list[str]:
    """Names of the expressions in an NFTA_SET_EXPR(ESSIONS)-style nest."""
    return [nl.get_str(nl.attrs(v).get(EXPR_NAME, b"")) for _t, v in nl.attr_list(buf)]


def decode_set(attrs: Mapping[int, bytes], family: int) -> SetInfo:
    """A NEWSET message's attributes -> SetInfo (raises MalformedError and friends on junk)."""
    name = nl.get_str(attrs[SET_NAME])
    table = nl.get_str(attrs.get(SET_TABLE, b""))
    flags = nl.get_be32(attrs[SET_FLAGS]) if SET_FLAGS in attrs else 0
    key_type = nl.get_be32(attrs[SET_KEY_TYPE]) if SET_KEY_TYPE in attrs else 0
    key_len = nl.get_be32(attrs[SET_KEY_LEN])
    key_types = split_concat(key_type)
    decl: dict[str, Any] = {}
    names = [_type(t).name for t in key_types]
    decl["type"] = names if len(names) > 1 else names[0]
    data_types: list[int] = []
    data_len = 0
    if flags & SET_MAP:
        data_type = nl.get_be32(attrs[SET_DATA_TYPE])
        data_len = nl.get_be32(attrs.get(SET_DATA_LEN, b"\0\0\0\0"))
        data_types = [1] if data_type == DATA_VERDICT_TYPE else split_concat(data_type)
        decl["map"] = " . ".join(_type(t).name for t in data_types)  # nft 1.0.6: "a . b", a string
    elif flags & SET_OBJECT:
        obj = nl.get_be32(attrs[SET_OBJ_TYPE]) if SET_OBJ_TYPE in attrs else 0
        decl["map"] = _OBJ_TYPES.get(obj, f"object_{obj}")
    # nft 1.0.6's flags, in its order; `dynamic` (NFT_SET_EVAL), which 1.0.9+ adds to sets
    # an `update` fills, is left out: the same set either way.
    listed = [n for bit, n in ((SET_CONSTANT, "constant"), (SET_INTERVAL, "interval"), (SET_TIMEOUT, "timeout"))
              if flags & bit]
    if not flags & SET_CONSTANT and SET_DESC in attrs:
        desc = nl.attrs(attrs[SET_DESC])
        if SET_DESC_SIZE in desc and nl.get_be32(desc[SET_DESC_SIZE]):
            decl["size"] = nl.get_be32(desc[SET_DESC_SIZE])
    if listed:
        decl["flags"] = listed
    stmts: list[str] = []
    if SET_EXPR in attrs:
        stmts = [nl.get_str(nl.attrs(attrs[SET_EXPR]).get(EXPR_NAME, b""))]
    elif SET_EXPRESSIONS in attrs:
        stmts = _stmt_names(attrs[SET_EXPRESSIONS])
    if stmts:
        decl["stmt"] = [{"counter": None} if s == "counter" else {"opaque": f"set statement {s}"} for s in stmts]
    # nft records integers' byte order in the set's userdata (a u32 in host order)
    ud = _udata(attrs.get(SET_USERDATA, b""))
    host, data_host = (len(ud.get(i, b"")) == 4 and int.from_bytes(ud[i], sys.byteorder) == BYTEORDER_HOST
                       for i in (UDATA_SET_KEYBYTEORDER, UDATA_SET_DATABYTEORDER))
    decode_data = None
    if data_types and data_types != [1]:
        decode_data = _value_decoder(data_types, data_len, data_host)
    return SetInfo(name=name, table=table, family=family, flags=flags, key_types=tuple(key_types), key_len=key_len,
                   data_types=tuple(data_types), data_len=data_len, decl=decl,
                   handle=nl.get_be64(attrs[SET_HANDLE]) if SET_HANDLE in attrs else None,
                   key_host_order=host, decode_key=_value_decoder(key_types, key_len, host),
                   decode_data=decode_data)


# --- set elements: the hot path -----------------------------------------------------------

class Element(NamedTuple):
    key: ElemKey
    value: Any  # map data (decoded), None for a plain set
    comment: str | None
    counter: tuple[int, int] | None  # (packets, bytes)
    expires_ms: int | None
    timeout_ms: int | None


def _verdict(buf: bytes) -> Any:
    """A nested NFTA_DATA_VERDICT -> nft JSON ({"goto": {"target": c}}, {"accept": None}, ...)."""
    a = nl.attrs(buf)
    code = nl.get_sbe32(a[VERDICT_CODE])
    if code in _CHAIN_VERDICTS and VERDICT_CHAIN in a:
        chain = nl.get_str(a[VERDICT_CHAIN])
        value: Any = goto(chain) if code == -4 else {_CHAIN_VERDICTS[code]: {"target": chain}}
    elif code in _VERDICTS:
        value = {_VERDICTS[code]: None}
    else:
        value = {"opaque": f"verdict {code}"}
    return value


# A counter expression as the kernel dumps it: its name, then its data nest with the
# byte and packet counts (read in one call when laid out so; otherwise attribute by attribute).
_COUNTER = struct.Struct("!12s4s4sQ4sQ")
_COUNTER_HEAD = (b"\x0c\x00\x01\x00counter\x00", b"\x1c\x00\x02\x00", b"\x0c\x00\x01\x00")
_COUNTER_PACKETS = b"\x0c\x00\x02\x00"


def _counter_of(buf: bytes, a: int, b: int) -> tuple[int, int] | None:
    """(packets, bytes) if the expression nest buf[a:b] is a counter."""
    if b - a >= 40:
        name, data, h1, nbytes, h2, packets = _COUNTER.unpack_from(buf, a)
        if (name, data, h1) == _COUNTER_HEAD and h2 == _COUNTER_PACKETS:
            return packets, nbytes
    name = data = None
    for t, x, y in nl.iter_attrs(buf, a, b):
        if t == EXPR_NAME:
            name = buf[x:y]
        elif t == EXPR_DATA:
            data = (x, y)
    if name != b"counter\0" or data is None:
        return None
    packets = nbytes = 0
    for t, x, _y in nl.iter_attrs(buf, data[0], data[1]):
        if t == COUNTER_PACKETS:
            packets = _BE64.unpack_from(buf, x)[0]
        elif t == COUNTER_BYTES:
            nbytes = _BE64.unpack_from(buf, x)[0]
    return packets, nbytes


def _data(raw: bytes, kind: int, decode: Callable[[bytes], tuple[Any, ...]] | None) -> Any:
    """A map element's data: a verdict, or a value of the map's data type."""
    if kind == DATA_VERDICT:
        return _verdict(raw)
    if decode is None:
        return {"opaque": "data " + raw.hex()}
    parts = decode(raw)
    return parts if len(parts) > 1 else parts[0]  # concatenated data as a tuple (ruleset.Elem)


def decode_elements(buf: bytes, start: int, end: int, info: SetInfo,
                    key_cache: dict[bytes, ElemKey] | None = None) -> list[Element]:
    """The elements of an NFTA_SET_ELEM_LIST_ELEMENTS nest (buf[start:end]). One element
    that does not parse ends the list with a marker element (key ("<malformed>", n))."""
    unpack = _NLA.unpack_from
    be64 = _BE64.unpack_from
    decode_key = info.decode_key
    decode_data = info.decode_data
    verdict_map = info.data_types == (1,)
    cache = key_cache if key_cache is not None else {}
    data_cache: dict[bytes, Any] = {}
    out: list[Element] = []
    off = start
    try:
        while off + 4 <= end:
            ln, _typ = unpack(buf, off)
            if ln < 4 or off + ln > end:
                raise MalformedError("element length")
            e_end = off + ln
            p = off + 4
            key = None
            value = None
            comment = None
            counter = None
            expires = timeout = None
            flags = 0
            while p + 4 <= e_end:
                l2, t2 = unpack(buf, p)
                if l2 < 4 or p + l2 > e_end:
                    raise MalformedError("element attribute length")
                t2 &= _MASK
                if t2 == ELEM_KEY or t2 == ELEM_DATA:
                    l3, t3 = unpack(buf, p + 4)
                    if l3 < 4 or p + 4 + l3 > p + l2:
                        raise MalformedError("element data length")
                    raw = buf[p + 8:p + 4 + l3]
                    t3 &= _MASK
                    if t2 == ELEM_KEY:
                        key = cache.get(raw)
                        if key is None:
                            key = cache[raw] = decode_key(raw)
                    else:  # one value object per distinct data within this list (treat as read-only)
                        value = data_cache.get(raw)
                        if value is None:
                            value = data_cache[raw] = _data(raw, t3, decode_data)
                elif t2 == ELEM_EXPR:
                    counter = _counter_of(buf, p + 4, p + l2)
                elif t2 == ELEM_EXPRESSIONS:
                    for _t, x, y in nl.iter_attrs(buf, p + 4, p + l2):
                        counter = _counter_of(buf, x, y) or counter
                elif t2 == ELEM_USERDATA:
                    ud = _udata(buf[p + 4:p + l2])
                    if UDATA_ELEM_COMMENT in ud:
                        comment = nl.get_str(ud[UDATA_ELEM_COMMENT])
                elif t2 == ELEM_EXPIRATION:
                    expires = be64(buf, p + 4)[0]
                elif t2 == ELEM_TIMEOUT:
                    timeout = be64(buf, p + 4)[0]
                elif t2 == ELEM_FLAGS:
                    flags = _BE32.unpack_from(buf, p + 4)[0]
                elif t2 == ELEM_OBJREF:
                    value = {"opaque": "object " + nl.get_str(buf[p + 4:p + l2])}
                elif t2 == ELEM_KEY_END:
                    flags |= _RANGE
                p += (l2 + 3) & ~3
            if flags & ELEM_CATCHALL:
                key = ("*",)
            elif flags & (ELEM_INTERVAL_END | _RANGE) or info.flags & SET_INTERVAL:
                key = ("<interval>", len(out))  # ranges: not decoded (the agent has none)
            elif key is None:
                key = ("<nokey>", len(out))
            if verdict_map and value is None:
                value = {"opaque": "no verdict"}
            out.append(Element(key, value, comment, counter, expires, timeout))
            off += (ln + 3) & ~3
    except (MalformedError, struct.error, IndexError, KeyError, ValueError):
        out.append(Element(("<malformed>", len(out)), {"opaque": "malformed element"}, None, None, None, None))
    return out


# --- chains -----------------------------------------------------------------------------

def decode_chain(attrs: Mapping[int, bytes], family: int) -> tuple[str, dict[str, Any], int]:
    """(name, canonical declaration, flags) of a NEWCHAIN message."""
    name = nl.get_str(attrs[CHAIN_NAME])
    flags = nl.get_be32(attrs[CHAIN_FLAGS]) if CHAIN_FLAGS in attrs else 0
    decl: dict[str, Any] = {}
    if CHAIN_HOOK in attrs:
        hook = nl.attrs(attrs[CHAIN_HOOK])
        num = nl.get_be32(hook[HOOK_HOOKNUM])
        hooks = _HOOKS.get(FAMILY_NAMES.get(family, ""), ())
        decl["type"] = nl.get_str(attrs.get(CHAIN_TYPE, b"filter\0"))
        decl["hook"] = hooks[num] if num < len(hooks) else f"hook_{num}"
        decl["prio"] = nl.get_sbe32(hook[HOOK_PRIORITY])
        policy = nl.get_be32(attrs[CHAIN_POLICY]) if CHAIN_POLICY in attrs else 1
        decl["policy"] = {0: "drop", 1: "accept"}.get(policy, f"policy_{policy}")
    return name, decl, flags


# --- rules ------------------------------------------------------------------------------

class _Opaque(Exception):
    """The rule cannot be rebuilt with certainty; the message says why."""


class _Operand:
    __slots__ = ("json", "length", "types", "kind", "used", "extra")

    def __init__(self, json: Any, length: int, types: tuple[int, ...], kind: str, extra: Any = None) -> None:
        self.json = json
        self.length = length
        self.types = types  # datatype ids of the value
        self.kind = kind  # "load", "numgen", "map", "imm"
        self.used = False
        self.extra = extra  # for "imm": the raw bytes


_PAYLOADS = {  # (base, offset, len) -> nft's name; ip family only
    (1, 12, 4): ({"payload": {"protocol": "ip", "field": "saddr"}}, (7,)),
    (1, 16, 4): ({"payload": {"protocol": "ip", "field": "daddr"}}, (7,)),
    (2, 0, 2): ({"payload": {"protocol": "th", "field": "sport"}}, (13,)),
    (2, 2, 2): ({"payload": {"protocol": "th", "field": "dport"}}, (13,)),
}
_META = {16: ({"meta": {"key": "l4proto"}}, 1, (12,)), 3: ({"meta": {"key": "mark"}}, 4, (19,)),
         6: ({"meta": {"key": "iifname"}}, 16, (41,)), 7: ({"meta": {"key": "oifname"}}, 16, (41,))}
_META_SETTABLE = {3}  # meta mark set
_CT_KEYS = {19: "ip saddr", 20: "ip daddr"}  # NFT_CT_SRC_IP, NFT_CT_DST_IP
_CT_DIRS = {0: "original", 1: "reply"}
_MARK_MASK = 0xFFFFFFFF
_CMP_OPS = {0: "==", 1: "!=", 2: "<", 3: "<=", 4: ">", 5: ">="}
NAT_MAP_IPS, NAT_PROTO_SPECIFIED, NAT_RANDOM_FULLY = 0x1, 0x2, 0x10


def _reg32(reg: int) -> int:
    if 1 <= reg <= 4:
        return (reg - 1) * 4
    if 8 <= reg <= 23:
        return reg - 8
    raise _Opaque(f"register {reg}")


class _Rule:
    """Register-tracking rebuild of one rule's statements."""

    def __init__(self, family: int, sets: Mapping[str, SetInfo], anon: Mapping[str, list[Element]],
                 bindings: Iterable[str] = ()) -> None:
        self.family = family
        self.sets = sets
        self.anon = anon
        self.bindings = bindings
        self.regs: dict[int, _Operand | tuple[str, _Operand]] = {}
        self.stmts: list[Any] = []
        self.l4proto_cmp = False

    def load(self, dreg: int, operand: _Operand) -> None:
        r = _reg32(dreg)
        n = max(1, (operand.length + 3) // 4)
        if r + n > 16:
            raise _Opaque("register overflow")
        for i in range(r, r + n):
            old = self.regs.get(i)
            if isinstance(old, _Operand) and not old.used:
                raise _Opaque("register overwritten before use")
            if isinstance(old, tuple):  # the tail of a longer value: that value is gone
                base = old[1]
                if not base.used:
                    raise _Opaque("register overwritten before use")
                for j in [j for j, v in self.regs.items() if v is base or (isinstance(v, tuple) and v[1] is base)]:
                    del self.regs[j]
        self.regs[r] = operand
        for i in range(r + 1, r + n):
            self.regs[i] = ("cont", operand)

    def take(self, sreg: int, length: int) -> list[_Operand]:
        """The operands filling `length` bytes from sreg (a concatenation if several)."""
        r = _reg32(sreg)
        first = self.regs.get(r)
        if not isinstance(first, _Operand):
            raise _Opaque(f"read of unset register {sreg}")
        if first.length == length:
            first.used = True
            return [first]
        parts, total, i = [], 0, r
        while total < length:
            op = self.regs.get(i)
            if not isinstance(op, _Operand):
                raise _Opaque("concatenation with a gap")
            parts.append(op)
            n = (op.length + 3) // 4
            total += 4 * n
            i += n
        if total != length or len(parts) < 2:
            raise _Opaque("concatenation length")
        for op in parts:
            op.used = True
        return parts

    @staticmethod
    def key_json(parts: list[_Operand]) -> Any:
        return parts[0].json if len(parts) == 1 else {"concat": [p.json for p in parts]}

    def set_ref(self, name: str, info: SetInfo) -> Any:
        """A named set as "@name"; an anonymous one inline, as nft lists it (only those
        keyed by plain integers, numgen's: the forms verified against nft's listing)."""
        if not info.anonymous:
            return f"@{name}"
        elems = self.anon.get(name)
        if elems is None:
            raise _Opaque(f"anonymous set {name} not read")
        if info.flags & SET_INTERVAL or info.key_types != (4,):
            raise _Opaque("anonymous set beyond integer keys")
        items = []
        for e in elems:
            if e.comment or e.counter or e.timeout_ms or e.expires_ms or len(e.key) != 1 or \
                    not isinstance(e.key[0], int) or (isinstance(e.value, dict) and "opaque" in e.value):
                raise _Opaque("anonymous set element beyond plain integers")
            items.append((e.key[0], e.value))
        items.sort(key=lambda kv: kv[0])  # nft lists anonymous sets sorted
        if info.is_map:
            return {"set": [[k, data_json(v)] for k, v in items]}
        return {"set": [k for k, _ in items]}

    def run(self, exprs: list[tuple[str, dict[int, bytes]]]) -> list[Any]:
        for name, a in exprs:
            handler = getattr(self, "x_" + name, None)
            if handler is None:
                raise _Opaque(f"expression {name}")
            handler(a)
        for v in self.regs.values():
            if isinstance(v, _Operand) and not v.used:
                raise _Opaque("value loaded and not used")
        if not self.stmts:
            raise _Opaque("no statement")
        return self.stmts

    # expressions -----------------------------------------------------------------------
    def x_payload(self, a: dict[int, bytes]) -> None:
        if 5 in a or 1 not in a:  # NFTA_PAYLOAD_SREG: a payload write
            raise _Opaque("payload write")
        base, off, ln = (nl.get_be32(a[i]) for i in (2, 3, 4))
        known = _PAYLOADS.get((base, off, ln)) if self.family == FAMILIES["ip"] else None
        if known is None:
            raise _Opaque(f"payload base {base} offset {off} len {ln}")
        if base == 2 and self.l4proto_cmp:
            raise _Opaque("transport header after a protocol match (nft lists it as the protocol's field)")
        self.load(nl.get_be32(a[1]), _Operand(known[0], ln, known[1], "load"))

    def x_meta(self, a: dict[int, bytes]) -> None:
        key = nl.get_be32(a[2])
        known = _META.get(key)
        if known is None:
            raise _Opaque(f"meta key {key}")
        if 3 in a:  # NFTA_META_SREG: `meta mark set <value>`
            if key not in _META_SETTABLE:
                raise _Opaque(f"meta set of key {key}")
            value = self.take(nl.get_be32(a[3]), known[1])
            self.stmts.append({"mangle": {"key": known[0], "value": self.key_json(value)}})
            return
        if 1 not in a:
            raise _Opaque("meta without a register")
        self.load(nl.get_be32(a[1]), _Operand(known[0], known[1], known[2], "load"))

    def x_bitwise(self, a: dict[int, bytes]) -> None:
        """`mark & M` and `mark | X`, as nft writes them (mask and xor over a mark)."""
        if nl.get_be32(a[6]) if 6 in a else 0:
            raise _Opaque("bitwise shift or register operation")
        length = nl.get_be32(a[3])
        parts = self.take(nl.get_be32(a[1]), length)
        if len(parts) != 1 or parts[0].types != (19,) or length != 4:
            raise _Opaque("bitwise beyond a mark")
        mask, xor = (_host_int(nl.attrs(a[i])[DATA_VALUE]) for i in (4, 5))
        if xor == 0:
            json: Any = {"&": [parts[0].json, mask]}
        elif mask | xor == _MARK_MASK and not mask & xor:
            json = {"|": [parts[0].json, xor]}
        else:
            raise _Opaque("bitwise form")
        self.load(nl.get_be32(a[2]), _Operand(json, 4, (19,), "load"))

    def x_ct(self, a: dict[int, bytes]) -> None:
        if 4 in a or 1 not in a:
            raise _Opaque("ct set")
        key, direction = nl.get_be32(a[2]), a[3][0] if 3 in a else None  # NFTA_CT_DIRECTION: a u8
        name = _CT_KEYS.get(key)
        if name is None or direction not in _CT_DIRS:
            raise _Opaque(f"ct key {key}")
        self.load(nl.get_be32(a[1]), _Operand({"ct": {"key": name, "dir": _CT_DIRS[direction]}}, 4, (7,), "load"))

    def x_numgen(self, a: dict[int, bytes]) -> None:
        mode = {0: "inc", 1: "random"}.get(nl.get_be32(a[3]) if 3 in a else 0)
        if mode is None:
            raise _Opaque("numgen mode")
        offset = nl.get_be32(a[4]) if 4 in a else 0
        self.load(nl.get_be32(a[1]), _Operand(
            {"numgen": {"mode": mode, "mod": nl.get_be32(a[2]), "offset": offset}}, 4, (4,), "numgen"))

    def x_immediate(self, a: dict[int, bytes]) -> None:
        dreg = nl.get_be32(a[1])
        data = nl.attrs(a[2])
        if dreg == 0:
            if DATA_VERDICT not in data:
                raise _Opaque("immediate to the verdict register without a verdict")
            v = _verdict(data[DATA_VERDICT])
            if "opaque" in v:
                raise _Opaque(v["opaque"])
            target = next(iter(v.values()))
            if isinstance(target, dict) and target.get("target") in self.bindings:
                raise _Opaque("jump to an anonymous chain (nft lists it inline)")
            self.stmts.append(v)
            return
        raw = data.get(DATA_VALUE)
        if raw is None:
            raise _Opaque("immediate without a value")
        self.load(dreg, _Operand(None, len(raw), (), "imm", raw))

    def x_cmp(self, a: dict[int, bytes]) -> None:
        op = _CMP_OPS.get(nl.get_be32(a[2]))
        raw = nl.attrs(a[3]).get(DATA_VALUE)
        if op is None or raw is None:
            raise _Opaque("cmp")
        parts = self.take(nl.get_be32(a[1]), len(raw))
        left = parts[0]
        if len(parts) != 1 or len(left.types) != 1 or left.kind != "load":
            raise _Opaque("cmp of a composite value")
        t = _type(left.types[0])
        if t.decode is None or t.size != len(raw):
            raise _Opaque("cmp value type")
        if left.json == {"meta": {"key": "l4proto"}}:
            self.l4proto_cmp = True
        self.stmts.append({"match": {"op": op, "left": left.json, "right": t.decode(raw)}})

    def x_lookup(self, a: dict[int, bytes]) -> None:
        name = nl.get_str(a[1])
        info = self.sets.get(name)
        if info is None:
            raise _Opaque(f"lookup in unknown set {name}")
        flags = nl.get_be32(a[5]) if 5 in a else 0
        if flags & ~1:
            raise _Opaque("lookup flags")
        key = self.key_json(self.take(nl.get_be32(a[2]), info.key_len))
        dreg = nl.get_be32(a[3]) if 3 in a else None
        if dreg is None:
            if info.is_map:
                raise _Opaque("lookup in a map without a result")
            if info.anonymous:
                raise _Opaque("match against an anonymous set")
            self.stmts.append({"match": {"op": "!=" if flags & 1 else "==", "left": key,
                                         "right": self.set_ref(name, info)}})
            return
        if flags & 1 or not info.is_map:
            raise _Opaque("inverted or set lookup with a result")
        ref = self.set_ref(name, info)
        if dreg == 0:
            if info.data_types != (1,):
                raise _Opaque("verdict lookup in a data map")
            self.stmts.append({"vmap": {"key": key, "data": ref}})
            return
        self.load(dreg, _Operand({"map": {"key": key, "data": ref}}, info.data_len, info.data_types, "map"))

    def x_nat(self, a: dict[int, bytes]) -> None:
        kind = {0: "snat", 1: "dnat"}.get(nl.get_be32(a[1]))
        family = nl.get_be32(a[2]) if 2 in a else 0
        flags = nl.get_be32(a[7]) if 7 in a else 0
        if kind is None or family != FAMILIES["ip"] or flags & ~(NAT_MAP_IPS | NAT_PROTO_SPECIFIED | NAT_RANDOM_FULLY):
            raise _Opaque("nat beyond address and port")
        amin, amax = (nl.get_be32(a[i]) if i in a else None for i in (3, 4))
        pmin, pmax = (nl.get_be32(a[i]) if i in a else None for i in (5, 6))
        if amin is None or (amax not in (None, amin)) or (pmax not in (None, pmin)):
            raise _Opaque("nat with ranges")
        r = _reg32(amin)
        addr = self.regs.get(r)
        if not isinstance(addr, _Operand):
            raise _Opaque("nat address from an unset register")
        if addr.kind == "load" and addr.types == (7,) and pmin is None and flags & NAT_MAP_IPS:
            addr.used = True  # an address from the packet or conntrack: `snat to ct original ip daddr`
            stmt = {"family": "ip", "addr": addr.json}
            if flags & NAT_RANDOM_FULLY:
                stmt["flags"] = ["fully-random"]
            self.stmts.append({kind: stmt})
            return
        if flags & NAT_RANDOM_FULLY:
            raise _Opaque("nat flags")
        if addr.kind == "map" and addr.types == (7, 13) and pmin is not None and _reg32(pmin) == r + 1 \
                and flags == NAT_MAP_IPS | NAT_PROTO_SPECIFIED:
            addr.used = True  # address and port from one map of concatenated data
            self.stmts.append({kind: {"family": "ip", "addr": addr.json}})
            return
        if addr.kind == "imm" and addr.length == 4 and flags & NAT_MAP_IPS:  # constants: `dnat to a.b.c.d:p`
            body: dict[str, Any] = {"addr": _ipv4(addr.extra)}
            addr.used = True
            if pmin is not None:
                port = self.regs.get(_reg32(pmin))
                if not isinstance(port, _Operand) or port.kind != "imm" or port.length != 2 \
                        or not flags & NAT_PROTO_SPECIFIED:
                    raise _Opaque("nat port form")
                port.used = True
                body["port"] = _be_int(port.extra)
            elif flags & NAT_PROTO_SPECIFIED:
                raise _Opaque("nat port flag without a port")
            self.stmts.append({kind: body})
            return
        raise _Opaque("nat form")

    def x_dynset(self, a: dict[int, bytes]) -> None:
        op = {0: "add", 1: "update", 2: "delete"}.get(nl.get_be32(a[3]))
        name = nl.get_str(a[1])
        info = self.sets.get(name)
        if op is None or info is None or info.anonymous:
            raise _Opaque("dynset")
        if 5 in a or 7 in a or 10 in a or (9 in a and nl.get_be32(a[9])):
            raise _Opaque("dynset with data or statements")
        key = self.key_json(self.take(nl.get_be32(a[4]), info.key_len))
        elem: Any = key
        ms = nl.get_be64(a[6]) if 6 in a else 0
        if ms:  # 0: the set's own timeout (nft lists no timeout)
            if ms % 1000:
                raise _Opaque("dynset timeout in milliseconds")
            elem = {"elem": {"val": key, "timeout": ms // 1000}}
        self.stmts.append({"set": {"op": op, "elem": elem, "set": f"@{name}"}})

    def x_counter(self, a: dict[int, bytes]) -> None:
        self.stmts.append({"counter": {"packets": nl.get_be64(a[COUNTER_PACKETS]) if COUNTER_PACKETS in a else 0,
                                       "bytes": nl.get_be64(a[COUNTER_BYTES]) if COUNTER_BYTES in a else 0}})


def rule_expressions(buf: bytes) -> list[tuple[str, dict[int, bytes]]]:
    out = []
    for _t, v in nl.attr_list(buf):
        e = nl.attrs(v)
        out.append((nl.get_str(e.get(EXPR_NAME, b"")), nl.attrs(e[EXPR_DATA]) if EXPR_DATA in e else {}))
    return out


def decode_rule(attrs: Mapping[int, bytes], family: int, sets: Mapping[str, SetInfo],
                anon: Mapping[str, list[Element]], bindings: Iterable[str] = ()) -> dict[str, Any]:
    """A NEWRULE message's attributes -> {"expr": [...]} (+ "comment"); never raises."""
    rule: dict[str, Any]
    try:
        exprs = rule_expressions(attrs.get(RULE_EXPRESSIONS, b""))
    except (MalformedError, KeyError, ValueError, struct.error, IndexError):
        exprs = None
    if exprs is None:
        rule = {"expr": [{"opaque": "malformed expressions"}]}
    else:
        try:
            rule = {"expr": _Rule(family, sets, anon, bindings).run(exprs)}
        except _Opaque as why:
            rule = {"expr": [{"opaque": f"{','.join(n for n, _ in exprs)}: {why}"}]}
        except (MalformedError, KeyError, ValueError, struct.error, IndexError, TypeError) as err:
            rule = {"expr": [{"opaque": f"{','.join(n for n, _ in exprs)}: malformed ({type(err).__name__})"}]}
    try:
        ud = _udata(attrs.get(RULE_USERDATA, b""))
        if UDATA_RULE_COMMENT in ud:
            rule["comment"] = nl.get_str(ud[UDATA_RULE_COMMENT])
    except (ValueError, IndexError):
        pass
    return rule


# --- the table --------------------------------------------------------------------------

@dataclass(frozen=True)
class TableState:
    """One table's objects in the agent's canonical forms. Equality compares content
    (not the generation it was read at)."""

    sets: dict[str, dict[str, Any]]  # named sets and maps -> declaration
    chains: dict[str, dict[str, Any]]  # name -> declaration ({} for a regular chain)
    rules: dict[str, tuple[dict[str, Any], ...]]  # chain -> its rules, in order
    elements: dict[str, dict[ElemKey, Elem]]  # map -> key -> Elem(value, comment)
    counters: dict[str, dict[ElemKey, tuple[int, int]]]  # map -> key -> (packets, bytes)
    entries: dict[str, list[tuple[ElemKey, int | None]]]  # plain set -> [(key, ms to expiry)], sorted
    generation: int = field(default=0, compare=False)
    set_info: dict[str, SetInfo] = field(default_factory=dict, compare=False, repr=False)
    notifications: tuple[Message, ...] = field(default=(), compare=False, repr=False)
    attempts: int = field(default=1, compare=False)  # passes read_table made
    interrupted: bool = field(default=False, compare=False)  # the kept pass saw NLM_F_DUMP_INTR

    def ruleset(self) -> Ruleset:
        return Ruleset(sets=self.sets, chains=self.chains, rules=self.rules, elements=self.elements)


class TableChanged(NetlinkError):
    """The table changed during every one of the bounded read attempts."""


def generation(sock: NfSocket) -> int:
    m = sock.request(GETGEN, 0)
    if m is None:
        raise NetlinkError(errnos.EPROTO, "getgen", "no answer")
    return nl.get_be32(m.attrs()[GEN_ID])


def _t(s: str) -> bytes:
    return nl.attr_str(1, s)


def dump_table(sock: NfSocket, family: int, table: str, elements: bool = True,
               record: list[bytes] | None = None) -> tuple[TableState | None, bool]:
    """One pass over the table's objects: (state or None if the table does not exist,
    whether any dump was interrupted). `record` collects every message's raw bytes."""
    interrupted = False

    def run(dump: nl.Dump) -> list[Message]:
        nonlocal interrupted
        msgs = list(dump)
        interrupted |= dump.interrupted
        if record is not None:
            record.extend(m.raw for m in msgs)
        return msgs

    try:
        answer = sock.request(GETTABLE, family, [_t(table)])
    except NetlinkError as err:
        if err.errno == errnos.ENOENT:
            return None, False
        raise
    if record is not None and answer is not None:
        record.append(answer.raw)
    set_msgs = run(sock.dump(GETSET, family, [_t(table)]))
    elem_msgs: dict[str, list[Message]] = {}
    infos = decode_sets(set_msgs)
    for name, info in infos.items():
        if info.anonymous or elements:
            elem_msgs[name] = run(sock.dump(GETSETELEM, family, [_t(table), nl.attr_str(ELIST_SET, name)]))
    chain_msgs = run(sock.dump(GETCHAIN, family, [_t(table)]))
    rule_msgs = run(sock.dump(GETRULE, family, [_t(table)]))
    state = assemble(family, table, set_msgs, elem_msgs, chain_msgs, rule_msgs, elements, infos=infos)
    return state, interrupted


def decode_sets(set_msgs: Iterable[Message]) -> dict[str, SetInfo]:
    infos: dict[str, SetInfo] = {}
    for m in set_msgs:
        try:
            info = decode_set(m.attrs(), m.family)
        except (MalformedError, KeyError, ValueError, struct.error, IndexError):
            continue
        infos[info.name] = info
    return infos


def assemble(family: int, table: str, set_msgs: Iterable[Message], elem_msgs: Mapping[str, Iterable[Message]],
             chain_msgs: Iterable[Message], rule_msgs: Iterable[Message], elements: bool = True,
             gen: int = 0, infos: dict[str, SetInfo] | None = None) -> TableState:
    """Decode dumped messages into a TableState (the pure half of read_table; never
    raises). Without `elements`, named sets' and maps' contents are left out (maps are
    then absent from .elements, not empty). `infos`: the sets, if already decoded.

    The cyclic GC is held off meanwhile: the ~200,000 acyclic objects of 50,000 elements
    would otherwise trigger a dozen collections (measured: 0.22 -> 0.18 s at 10k x 4)."""
    set_msgs = list(set_msgs)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _assemble(family, table, set_msgs, elem_msgs, chain_msgs, rule_msgs, elements, gen,
                         decode_sets(set_msgs) if infos is None else infos)
    finally:
        if enabled:
            gc.enable()


def _assemble(family: int, table: str, set_msgs: list[Message], elem_msgs: Mapping[str, Iterable[Message]],
              chain_msgs: Iterable[Message], rule_msgs: Iterable[Message], elements: bool, gen: int,
              infos: dict[str, SetInfo]) -> TableState:
    sets: dict[str, dict[str, Any]] = {}
    elems: dict[str, dict[ElemKey, Elem]] = {}
    counters: dict[str, dict[ElemKey, tuple[int, int]]] = {}
    entries: dict[str, list[tuple[ElemKey, int | None]]] = {}
    anon: dict[str, list[Element]] = {}
    key_caches: dict[tuple[Any, ...], dict[bytes, ElemKey]] = {}
    for m in set_msgs:  # a set message that did not decode: marked under its name if known
        try:
            a = m.attrs()
            name = nl.get_str(a[SET_NAME])
        except (MalformedError, KeyError, ValueError):
            continue
        if name not in infos and nl.get_str(a.get(SET_TABLE, b"")) in (table, ""):
            sets[name] = {"opaque": "malformed set"}
    for name, info in infos.items():
        if info.table not in (table, ""):
            continue
        found: list[Element] = []
        cache = key_caches.setdefault((info.key_types, info.key_len, info.key_host_order), {})
        for m in elem_msgs.get(name, ()):
            try:
                for t, x, y in nl.iter_attrs(m.buf, m.start, m.end):
                    if t == ELIST_ELEMENTS:
                        found.extend(decode_elements(m.buf, x, y, info, cache))
            except MalformedError:
                found.append(Element(("<malformed>", len(found)), {"opaque": "malformed"}, None, None, None, None))
        if info.anonymous:
            anon[name] = found
            continue
        sets[name] = info.decl
        if not elements:
            continue
        if info.is_map or info.flags & SET_OBJECT:
            elems[name] = {e.key: element(e.value, e.comment) for e in found}
            if any(e.counter is not None for e in found):
                counters[name] = {e.key: e.counter for e in found if e.counter is not None}
        else:
            entries[name] = sorted(((e.key, e.expires_ms) for e in found), key=repr)  # not hash order
    chains: dict[str, dict[str, Any]] = {}
    bindings: set[str] = set()
    for m in chain_msgs:
        try:
            a = m.attrs()
            if nl.get_str(a.get(CHAIN_TABLE, b"")) != table or m.family != family:
                continue
            name, decl, flags = decode_chain(a, family)
        except (MalformedError, KeyError, ValueError, struct.error, IndexError):
            continue
        if flags & CHAIN_BINDING:  # an anonymous chain (`jump { ... }`): listed inside its rule
            bindings.add(name)
            continue
        chains[name] = decl
    rules: dict[str, list[dict[str, Any]]] = {name: [] for name in chains}
    for m in rule_msgs:
        try:
            a = m.attrs()
            if nl.get_str(a.get(RULE_TABLE, b"")) != table or m.family != family:
                continue
            chain = nl.get_str(a[RULE_CHAIN])
        except (MalformedError, KeyError, ValueError):
            continue
        if chain in bindings:
            continue
        rules.setdefault(chain, []).append(decode_rule(a, family, infos, anon, bindings))
    return TableState(sets=sets, chains=chains, rules={c: tuple(r) for c, r in rules.items()}, elements=elems,
                      counters=counters, entries=entries, generation=gen, set_info=infos)


def names_table(m: Message) -> str | None:
    """The table an nf_tables object notification names (attribute 1 of each kind)."""
    try:
        for t, x, y in nl.iter_attrs(m.buf, m.start, m.end):
            if t == 1:
                return nl.get_str(m.buf[x:y])
    except MalformedError:
        return None
    return None


def _gen_after(a: int, b: int) -> bool:
    """a is b or later, in u32 wrap-around order."""
    return ((a - b) & 0xFFFFFFFF) < 0x80000000


class _Batches:
    """Notifications grouped by the commit they belong to: each commit's object messages
    come before its NFT_MSG_NEWGEN, which carries the commit's generation."""

    def __init__(self) -> None:
        self.pending: list[Message] = []
        self.commits: list[tuple[int, list[Message]]] = []  # (generation, its object messages)
        self.seen: list[Message] = []

    def add(self, messages: Iterable[Message]) -> None:
        for m in messages:
            self.seen.append(m)
            if m.subsys != nl.NFNL_SUBSYS_NFTABLES:
                continue
            if m.msg == NEWGEN:
                try:
                    gen = nl.get_be32(m.attrs()[GEN_ID])
                except (MalformedError, KeyError, struct.error):
                    continue
                self.commits.append((gen, self.pending))
                self.pending = []
            else:
                self.pending.append(m)

    def last_gen(self) -> int | None:
        return self.commits[-1][0] if self.commits else None

    def touched(self, family: int, table: str, since: int, first: int = 0) -> bool:
        """Whether a commit numbered `since` or later, among commits[first:], or a
        commit still without its NEWGEN changed this table (or did not say which)."""
        for gen, msgs in self.commits[first:]:
            if not _gen_after(gen, since):
                continue
            for m in msgs:
                if m.family == family and names_table(m) in (table, None):
                    return True
        return any(m.family == family and names_table(m) in (table, None) for m in self.pending)


def read_table(family: str, table: str, *, elements: bool = True, sock: NfSocket | None = None,
               subscriber: Subscriber | None = None, attempts: int = 8, settle: float = 1.0,
               timeout: float | None = None) -> TableState | None:
    """The table's objects, consistent as of `generation`; None when it does not exist.

    Subscribes (or uses `subscriber`; what it drains is in .notifications) before the
    first dump, reads the generation before and after, and keeps the pass when the
    generation did not move or when every commit between the two (their notifications,
    waited for up to `settle` s) left this table alone. Raises TableChanged after
    `attempts` passes that each overlapped a change of this table, NetlinkError on
    kernel errors."""
    fam = FAMILIES[family]
    own_sock = sock is None
    sock = sock or NfSocket(timeout=timeout or nl.DEFAULT_TIMEOUT)
    own_sub = subscriber is None
    try:
        sub = subscriber if subscriber is not None else Subscriber()
    except OSError:  # no notifications (not permitted): the generation alone decides
        sub = None
    batches = _Batches()
    try:
        for attempt in range(1, attempts + 1):
            if sub is not None:
                batches.add(sub.drain().messages)  # commits announced by now finished before gen0
            mark = len(batches.commits)
            gen0 = generation(sock)
            state, interrupted = dump_table(sock, fam, table, elements)
            gen1 = generation(sock)
            if _consistent(sub, batches, mark, fam, table, gen0, gen1, settle):
                if state is None:
                    return None
                return TableState(state.sets, state.chains, state.rules, state.elements, state.counters,
                                  state.entries, gen1, state.set_info, tuple(batches.seen), attempt, interrupted)
        raise TableChanged(errnos.EAGAIN, f"read {family} {table}", f"changed during {attempts} reads")
    finally:
        if own_sub and sub is not None:
            sub.close()
        if own_sock:
            sock.close()


def _consistent(sub: Subscriber | None, batches: _Batches, mark: int, family: int, table: str, gen0: int,
                gen1: int, settle: float) -> bool:
    """Whether the pass between reading gen0 and gen1 saw the table as of one generation.

    Unmoved, it did, except if commit gen0 itself was still activating its objects when
    gen0 was read (the kernel bumps the generation just before): that commit's
    notifications, if they arrived since, are checked. Moved, every commit from gen0 to
    gen1 must have left the table alone; they are waited for (NEWGEN of gen1 comes last)
    up to `settle` s. False when unsure (an overrun, or no notifications at all)."""
    if sub is None:
        return gen0 == gen1
    deadline = time.monotonic() + settle
    while True:
        drained = sub.drain()
        batches.add(drained.messages)
        if drained.overrun:
            return False
        if gen0 == gen1:
            return not batches.touched(family, table, gen0, mark)
        last = batches.last_gen()
        if last is not None and _gen_after(last, gen1):
            return not batches.touched(family, table, gen0, mark)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        sub.wait(min(remaining, 0.05))


def read_set(family: str, table: str, name: str, *, sock: NfSocket | None = None) -> list[Element] | None:
    """One set's elements (keys, data, comments, counters, expiry), without the rest of
    the table: two round trips. None when the table or set does not exist."""
    fam = FAMILIES[family]
    own = sock is None
    sock = sock or NfSocket()
    try:
        try:
            m = sock.request(GETSET, fam, [_t(table), nl.attr_str(SET_NAME, name)])
        except NetlinkError as err:
            if err.errno == errnos.ENOENT:
                return None
            raise
        if m is None:
            return None
        info = decode_set(m.attrs(), fam)
        found: list[Element] = []
        try:
            for msg in sock.dump(GETSETELEM, fam, [_t(table), nl.attr_str(ELIST_SET, name)]):
                for t, x, y in nl.iter_attrs(msg.buf, msg.start, msg.end):
                    if t == ELIST_ELEMENTS:
                        found.extend(decode_elements(msg.buf, x, y, info))
        except NetlinkError as err:
            if err.errno == errnos.ENOENT:
                return None
            raise
        return found
    finally:
        if own:
            sock.close()


# --- notifications ----------------------------------------------------------------------

class Change(NamedTuple):
    """One decoded notification."""

    kind: str  # table, chain, rule, set, element, gen, object, flowtable, other
    op: str  # new, del
    family: str
    table: str | None
    name: str | None  # the chain, set or object; a rule's chain; an element's set
    portid: int  # the committing socket's netlink port id
    obj: Any  # chain/set: declaration; rule: rule dict; element: list[Element];
    # gen: {"id", "pid", "comm"}; None when not decoded (an unknown set's elements)
    handle: int | None = None


class _Known:
    """What a Decoder knows of one table: its sets (anonymous ones with their elements)
    and its anonymous chains."""

    def __init__(self) -> None:
        self.sets: dict[str, SetInfo] = {}
        self.anon: dict[str, list[Element]] = {}
        self.bindings: set[str] = set()


class Decoder:
    """Decodes notifications with the same code as dumps. Knows the sets of the tables
    it was given (TableState.set_info) and learns sets (anonymous ones with their
    elements) from NEWSET/NEWSETELEM, so element notifications and rules with inline maps
    decode too. `tables` ((family, name) pairs) limits what it learns to those tables
    (default: the given states' tables if any, else every table)."""

    def __init__(self, *states: TableState, tables: Iterable[tuple[str, str]] | None = None) -> None:
        self._known: dict[tuple[int, str], _Known] = {}
        self._learn: set[tuple[int, str]] | None = (
            {(FAMILIES[f], t) for f, t in tables} if tables is not None else None)
        for st in states:
            for info in st.set_info.values():
                self._table(info.family, info.table, True).sets[info.name] = info
        if states and self._learn is None:
            self._learn = set(self._known)

    def _table(self, family: int, table: str, create: bool = False) -> _Known | None:
        known = self._known.get((family, table))
        if known is None and (create or self._learn is None or (family, table) in self._learn):
            known = self._known[(family, table)] = _Known()
        return known

    def decode(self, m: Message) -> Change:
        kind, op = _KINDS.get(m.msg, ("other", "new")) if m.subsys == nl.NFNL_SUBSYS_NFTABLES else ("other", "new")
        family = FAMILY_NAMES.get(m.family, str(m.family))
        try:
            a = m.attrs()
        except MalformedError:
            return Change(kind, op, family, None, None, m.portid, None)
        try:
            return self._decode(kind, op, family, m, a)
        except (MalformedError, KeyError, ValueError, struct.error, IndexError):
            table = nl.get_str(a[1]) if kind not in ("gen", "other") and 1 in a else None
            return Change(kind, op, family, table, None, m.portid, None)

    def _decode(self, kind: str, op: str, family: str, m: Message, a: dict[int, bytes]) -> Change:
        fam = m.family
        if kind == "gen":
            obj = {"id": nl.get_be32(a[GEN_ID]), "pid": nl.get_be32(a[GEN_PROC_PID]) if GEN_PROC_PID in a else None,
                   "comm": nl.get_str(a[GEN_PROC_NAME]) if GEN_PROC_NAME in a else None}
            return Change(kind, op, family, None, None, m.portid, obj)
        if kind == "other":
            return Change(kind, op, family, None, None, m.portid, None)
        table = nl.get_str(a[1])
        known = self._table(fam, table)
        if kind == "table":
            if op == "del":
                self._known.pop((fam, table), None)
            return Change(kind, op, family, table, table, m.portid, None,
                          nl.get_be64(a[TABLE_HANDLE]) if TABLE_HANDLE in a else None)
        if kind == "chain":
            name, decl, flags = decode_chain(a, fam)
            if flags & CHAIN_BINDING and known is not None:
                (known.bindings.add if op == "new" else known.bindings.discard)(name)
            return Change(kind, op, family, table, name, m.portid, decl,
                          nl.get_be64(a[CHAIN_HANDLE]) if CHAIN_HANDLE in a else None)
        if kind == "set":
            info = decode_set(a, fam)
            if known is not None and op == "new":
                known.sets[info.name] = info
            elif known is not None:
                known.sets.pop(info.name, None)
                known.anon.pop(info.name, None)
            return Change(kind, op, family, table, info.name, m.portid, info.decl, info.handle)
        if kind == "element":
            name = nl.get_str(a[ELIST_SET])
            info = known.sets.get(name) if known is not None else None
            found: list[Element] | None = None
            if info is not None and ELIST_ELEMENTS in a:
                found = decode_elements(a[ELIST_ELEMENTS], 0, len(a[ELIST_ELEMENTS]), info)
                if info.anonymous and op == "new" and known is not None:
                    known.anon.setdefault(name, []).extend(found)
            return Change(kind, op, family, table, name, m.portid, found)
        if kind == "rule":
            chain = nl.get_str(a[RULE_CHAIN])
            k = known or _Known()
            return Change(kind, op, family, table, chain, m.portid, decode_rule(a, fam, k.sets, k.anon, k.bindings),
                          nl.get_be64(a[RULE_HANDLE]) if RULE_HANDLE in a else None)
        name = nl.get_str(a[2]) if 2 in a else None
        return Change(kind, op, family, table, name, m.portid, None)
