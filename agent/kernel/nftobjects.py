"""nf_tables sets, set elements and chains, decoded from their netlink attributes into the
agent's canonical forms (render.py's): one code path for dumps and for notifications.

Nothing here raises on an element the kernel (or a corrupt recording) sends: what does not
parse becomes a marker element that never equals a rendered one. The forms nft >= 1.0.9
lists differently (the `dynamic` flag of sets filled by `update`, a concatenated map type
as a list) come out in the 1.0.6 form, which is what render.py writes."""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from agent.core.ruleset import ElemKey, goto
from agent.kernel import nfnetlink as nl
from agent.kernel.nfnetlink import MalformedError, Message
from agent.kernel.nfttypes import TYPE_VERDICT, datatype, split_concat, value_decoder
from agent.kernel.nftuapi import (
    BYTEORDER_HOST_ENDIAN, FAMILY_NAMES, NFT_SET_ANONYMOUS, NFT_SET_CONSTANT, NFT_SET_ELEM_CATCHALL,
    NFT_SET_ELEM_INTERVAL_END, NFT_SET_INTERVAL, NFT_SET_MAP, NFT_SET_OBJECT, NFT_SET_TIMEOUT, NFTA_CHAIN_FLAGS,
    NFTA_CHAIN_HOOK, NFTA_CHAIN_NAME, NFTA_CHAIN_POLICY, NFTA_CHAIN_TYPE, NFTA_COUNTER_BYTES, NFTA_COUNTER_PACKETS,
    NFTA_DATA_VERDICT, NFTA_EXPR_DATA, NFTA_EXPR_NAME, NFTA_HOOK_HOOKNUM, NFTA_HOOK_PRIORITY, NFTA_SET_DATA_LEN,
    NFTA_SET_DATA_TYPE, NFTA_SET_DESC, NFTA_SET_DESC_SIZE, NFTA_SET_ELEM_DATA, NFTA_SET_ELEM_EXPIRATION,
    NFTA_SET_ELEM_EXPR, NFTA_SET_ELEM_EXPRESSIONS, NFTA_SET_ELEM_FLAGS, NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_KEY_END,
    NFTA_SET_ELEM_LIST_ELEMENTS, NFTA_SET_ELEM_OBJREF, NFTA_SET_ELEM_TIMEOUT, NFTA_SET_ELEM_USERDATA, NFTA_SET_EXPR,
    NFTA_SET_EXPRESSIONS, NFTA_SET_FLAGS, NFTA_SET_HANDLE, NFTA_SET_KEY_LEN, NFTA_SET_KEY_TYPE, NFTA_SET_NAME,
    NFTA_SET_OBJ_TYPE, NFTA_SET_TABLE, NFTA_SET_USERDATA, NFTA_VERDICT_CHAIN, NFTA_VERDICT_CODE,
    NFTNL_UDATA_SET_DATABYTEORDER, NFTNL_UDATA_SET_ELEM_COMMENT, NFTNL_UDATA_SET_KEYBYTEORDER)

NFT_GOTO = -4
# enum nft_verdicts (and linux/netfilter.h's NF_DROP, NF_ACCEPT)
_VERDICTS = {0: "drop", 1: "accept", -1: "continue", -2: "break", -5: "return"}
_CHAIN_VERDICTS = {-3: "jump", NFT_GOTO: "goto"}
_RANGE = 0x100  # (ours) the element had NFTA_SET_ELEM_KEY_END: a range, not decoded
_HOOKS = {"ip": ("prerouting", "input", "forward", "output", "postrouting"),
          "ip6": ("prerouting", "input", "forward", "output", "postrouting"),
          "inet": ("prerouting", "input", "forward", "output", "postrouting", "ingress"),
          "bridge": ("prerouting", "input", "forward", "output", "postrouting"),
          "arp": ("input", "output"), "netdev": ("ingress", "egress")}
# NFT_OBJECT_* (what an object map maps to)
_OBJ_TYPES = {1: "counter", 2: "quota", 3: "ct helper", 4: "limit", 7: "ct timeout", 8: "secmark",
              9: "ct expectation", 10: "synproxy"}


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
    data_types: tuple[int, ...]  # () for a plain set; (TYPE_VERDICT,) for verdict maps
    data_len: int
    decl: dict[str, Any]  # the canonical declaration (render.py's form)
    handle: int | None = None
    key_host_order: bool = False
    decode_key: Callable[[bytes], ElemKey] = field(default=lambda b: (b,), compare=False, repr=False)
    decode_data: Callable[[bytes], tuple[Any, ...]] | None = field(default=None, compare=False, repr=False)

    @property
    def anonymous(self) -> bool:
        return bool(self.flags & NFT_SET_ANONYMOUS)

    @property
    def is_map(self) -> bool:
        return bool(self.flags & NFT_SET_MAP)


def udata(value: bytes) -> dict[int, bytes]:
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
    return [nl.get_str(nl.attrs(v).get(NFTA_EXPR_NAME, b"")) for _t, v in nl.attr_list(buf)]


def decode_set(attrs: Mapping[int, bytes], family: int) -> SetInfo:
    """An NFT_MSG_NEWSET message's attributes -> SetInfo (raises MalformedError and friends on junk)."""
    name = nl.get_str(attrs[NFTA_SET_NAME])
    table = nl.get_str(attrs.get(NFTA_SET_TABLE, b""))
    flags = nl.get_be32(attrs[NFTA_SET_FLAGS]) if NFTA_SET_FLAGS in attrs else 0
    key_type = nl.get_be32(attrs[NFTA_SET_KEY_TYPE]) if NFTA_SET_KEY_TYPE in attrs else 0
    key_len = nl.get_be32(attrs[NFTA_SET_KEY_LEN])
    key_types = split_concat(key_type)
    decl: dict[str, Any] = {}
    names = [datatype(t).name for t in key_types]
    decl["type"] = names if len(names) > 1 else names[0]
    data_types: list[int] = []
    data_len = 0
    if flags & NFT_SET_MAP:
        data_type = nl.get_be32(attrs[NFTA_SET_DATA_TYPE])
        data_len = nl.get_be32(attrs.get(NFTA_SET_DATA_LEN, b"\0\0\0\0"))
        data_types = split_concat(data_type)  # [TYPE_VERDICT] for NFT_DATA_VERDICT
        decl["map"] = " . ".join(datatype(t).name for t in data_types)  # nft 1.0.6: "a . b", a string
    elif flags & NFT_SET_OBJECT:
        obj = nl.get_be32(attrs[NFTA_SET_OBJ_TYPE]) if NFTA_SET_OBJ_TYPE in attrs else 0
        decl["map"] = _OBJ_TYPES.get(obj, f"object_{obj}")
    # nft 1.0.6's flags, in its order; `dynamic` (NFT_SET_EVAL), which 1.0.9+ adds to sets
    # an `update` fills, is left out: the same set either way.
    listed = [n for bit, n in ((NFT_SET_CONSTANT, "constant"), (NFT_SET_INTERVAL, "interval"),
                               (NFT_SET_TIMEOUT, "timeout"))
              if flags & bit]
    if not flags & NFT_SET_CONSTANT and NFTA_SET_DESC in attrs:
        desc = nl.attrs(attrs[NFTA_SET_DESC])
        if NFTA_SET_DESC_SIZE in desc and nl.get_be32(desc[NFTA_SET_DESC_SIZE]):
            decl["size"] = nl.get_be32(desc[NFTA_SET_DESC_SIZE])
    if listed:
        decl["flags"] = listed
    stmts: list[str] = []
    if NFTA_SET_EXPR in attrs:
        stmts = [nl.get_str(nl.attrs(attrs[NFTA_SET_EXPR]).get(NFTA_EXPR_NAME, b""))]
    elif NFTA_SET_EXPRESSIONS in attrs:
        stmts = _stmt_names(attrs[NFTA_SET_EXPRESSIONS])
    if stmts:
        decl["stmt"] = [{"counter": None} if s == "counter" else {"opaque": f"set statement {s}"} for s in stmts]
    # nft records integers' byte order in the set's userdata (a u32 in host order)
    ud = udata(attrs.get(NFTA_SET_USERDATA, b""))
    host, data_host = (len(ud.get(i, b"")) == 4 and int.from_bytes(ud[i], sys.byteorder) == BYTEORDER_HOST_ENDIAN
                       for i in (NFTNL_UDATA_SET_KEYBYTEORDER, NFTNL_UDATA_SET_DATABYTEORDER))
    decode_data = None
    if data_types and data_types != [TYPE_VERDICT]:
        decode_data = value_decoder(data_types, data_len, data_host)
    return SetInfo(name=name, table=table, family=family, flags=flags, key_types=tuple(key_types), key_len=key_len,
                   data_types=tuple(data_types), data_len=data_len, decl=decl,
                   handle=nl.get_be64(attrs[NFTA_SET_HANDLE]) if NFTA_SET_HANDLE in attrs else None,
                   key_host_order=host, decode_key=value_decoder(key_types, key_len, host),
                   decode_data=decode_data)


def decode_sets(set_msgs: Iterable[Message]) -> dict[str, SetInfo]:
    """The sets of a dump by name (a message that does not decode is left out)."""
    infos: dict[str, SetInfo] = {}
    for m in set_msgs:
        try:
            info = decode_set(m.attrs(), m.family)
        except (MalformedError, KeyError, ValueError, struct.error, IndexError):
            continue
        infos[info.name] = info
    return infos


# --- set elements: the hot path -----------------------------------------------------------

class Element(NamedTuple):
    key: ElemKey
    value: Any  # map data (decoded), None for a plain set
    comment: str | None
    counter: tuple[int, int] | None  # (packets, bytes)
    expires_ms: int | None
    timeout_ms: int | None


def verdict(buf: bytes) -> Any:
    """A nested NFTA_DATA_VERDICT -> nft JSON ({"goto": {"target": c}}, {"accept": None}, ...)."""
    a = nl.attrs(buf)
    code = nl.get_sbe32(a[NFTA_VERDICT_CODE])
    if code in _CHAIN_VERDICTS and NFTA_VERDICT_CHAIN in a:
        chain = nl.get_str(a[NFTA_VERDICT_CHAIN])
        value: Any = goto(chain) if code == NFT_GOTO else {_CHAIN_VERDICTS[code]: {"target": chain}}
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
        if t == NFTA_EXPR_NAME:
            name = buf[x:y]
        elif t == NFTA_EXPR_DATA:
            data = (x, y)
    if name != b"counter\0" or data is None:
        return None
    packets = nbytes = 0
    for t, x, _y in nl.iter_attrs(buf, data[0], data[1]):
        if t == NFTA_COUNTER_PACKETS:
            packets = nl.BE64.unpack_from(buf, x)[0]
        elif t == NFTA_COUNTER_BYTES:
            nbytes = nl.BE64.unpack_from(buf, x)[0]
    return packets, nbytes


def _data(raw: bytes, kind: int, decode: Callable[[bytes], tuple[Any, ...]] | None) -> Any:
    """A map element's data: a verdict, or a value of the map's data type."""
    if kind == NFTA_DATA_VERDICT:
        return verdict(raw)
    if decode is None:
        return {"opaque": "data " + raw.hex()}
    parts = decode(raw)
    return parts if len(parts) > 1 else parts[0]  # concatenated data as a tuple (ruleset.Elem)


def decode_elements(buf: bytes, start: int, end: int, info: SetInfo,
                    key_cache: dict[bytes, ElemKey] | None = None) -> list[Element]:
    """The elements of an NFTA_SET_ELEM_LIST_ELEMENTS nest (buf[start:end]). One element
    that does not parse ends the list with a marker element (key ("<malformed>", n))."""
    unpack = nl.NLA.unpack_from
    be64 = nl.BE64.unpack_from
    decode_key = info.decode_key
    decode_data = info.decode_data
    verdict_map = info.data_types == (TYPE_VERDICT,)
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
                t2 &= nl.NLA_TYPE_MASK
                if t2 == NFTA_SET_ELEM_KEY or t2 == NFTA_SET_ELEM_DATA:
                    l3, t3 = unpack(buf, p + 4)
                    if l3 < 4 or p + 4 + l3 > p + l2:
                        raise MalformedError("element data length")
                    raw = buf[p + 8:p + 4 + l3]
                    t3 &= nl.NLA_TYPE_MASK
                    if t2 == NFTA_SET_ELEM_KEY:
                        key = cache.get(raw)
                        if key is None:
                            key = cache[raw] = decode_key(raw)
                    else:  # one value object per distinct data within this list (treat as read-only)
                        value = data_cache.get(raw)
                        if value is None:
                            value = data_cache[raw] = _data(raw, t3, decode_data)
                elif t2 == NFTA_SET_ELEM_EXPR:
                    counter = _counter_of(buf, p + 4, p + l2)
                elif t2 == NFTA_SET_ELEM_EXPRESSIONS:
                    for _t, x, y in nl.iter_attrs(buf, p + 4, p + l2):
                        counter = _counter_of(buf, x, y) or counter
                elif t2 == NFTA_SET_ELEM_USERDATA:
                    ud = udata(buf[p + 4:p + l2])
                    if NFTNL_UDATA_SET_ELEM_COMMENT in ud:
                        comment = nl.get_str(ud[NFTNL_UDATA_SET_ELEM_COMMENT])
                elif t2 == NFTA_SET_ELEM_EXPIRATION:
                    expires = be64(buf, p + 4)[0]
                elif t2 == NFTA_SET_ELEM_TIMEOUT:
                    timeout = be64(buf, p + 4)[0]
                elif t2 == NFTA_SET_ELEM_FLAGS:
                    flags = nl.BE32.unpack_from(buf, p + 4)[0]
                elif t2 == NFTA_SET_ELEM_OBJREF:
                    value = {"opaque": "object " + nl.get_str(buf[p + 4:p + l2])}
                elif t2 == NFTA_SET_ELEM_KEY_END:
                    flags |= _RANGE
                p += (l2 + 3) & ~3
            if flags & NFT_SET_ELEM_CATCHALL:
                key = ("*",)
            elif flags & (NFT_SET_ELEM_INTERVAL_END | _RANGE) or info.flags & NFT_SET_INTERVAL:
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


def elements_of(messages: Iterable[Message], info: SetInfo,
                key_cache: dict[bytes, ElemKey] | None = None) -> list[Element]:
    """The elements of a set's NFT_MSG_NEWSETELEM messages (a dump's, or one notification),
    in order. A message whose attributes do not parse ends its part with a marker element
    (key ("<malformed>", n))."""
    found: list[Element] = []
    for m in messages:
        try:
            for t, x, y in nl.iter_attrs(m.buf, m.start, m.end):
                if t == NFTA_SET_ELEM_LIST_ELEMENTS:
                    found.extend(decode_elements(m.buf, x, y, info, key_cache))
        except MalformedError:
            found.append(Element(("<malformed>", len(found)), {"opaque": "malformed"}, None, None, None, None))
    return found


# --- chains -----------------------------------------------------------------------------

def decode_chain(attrs: Mapping[int, bytes], family: int) -> tuple[str, dict[str, Any], int]:
    """(name, canonical declaration, flags) of an NFT_MSG_NEWCHAIN message."""
    name = nl.get_str(attrs[NFTA_CHAIN_NAME])
    flags = nl.get_be32(attrs[NFTA_CHAIN_FLAGS]) if NFTA_CHAIN_FLAGS in attrs else 0
    decl: dict[str, Any] = {}
    if NFTA_CHAIN_HOOK in attrs:
        hook = nl.attrs(attrs[NFTA_CHAIN_HOOK])
        num = nl.get_be32(hook[NFTA_HOOK_HOOKNUM])
        hooks = _HOOKS.get(FAMILY_NAMES.get(family, ""), ())
        decl["type"] = nl.get_str(attrs.get(NFTA_CHAIN_TYPE, b"filter\0"))
        decl["hook"] = hooks[num] if num < len(hooks) else f"hook_{num}"
        decl["prio"] = nl.get_sbe32(hook[NFTA_HOOK_PRIORITY])
        policy = nl.get_be32(attrs[NFTA_CHAIN_POLICY]) if NFTA_CHAIN_POLICY in attrs else 1
        decl["policy"] = {0: "drop", 1: "accept"}.get(policy, f"policy_{policy}")
    return name, decl, flags
