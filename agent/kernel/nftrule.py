"""The rule decompiler: one nf_tables rule's expressions (NFT_MSG_NEWRULE) rebuilt, by
meaning, as the statements nft's JSON lists for it, the forms render.py writes.

Registers are tracked (NFT_REG_1..4 are 16-byte registers aliasing NFT_REG32_00.. =
8..23; a concatenation fills consecutive 32-bit registers, each component rounded up to 4
bytes) and each statement is rebuilt in nft's JSON vocabulary. An expression sequence
outside that vocabulary becomes an opaque marker rule ({"expr": [{"opaque": "..."}]})
that never equals a rendered rule; nothing here raises on what the kernel (or a corrupt
recording) sends. Attributes are read by their uapi names (agent/kernel/nftuapi.py), and
each expression goes to its handler through one table, `_EXPRESSIONS`."""
from __future__ import annotations

import struct
from typing import Any, Callable, Iterable, Mapping

from agent.core.ruleset import data_json
from agent.kernel import nfnetlink as nl
from agent.kernel.nfnetlink import MalformedError
from agent.kernel.nftobjects import Element, SetInfo, udata, verdict
from agent.kernel.nfttypes import (
    TYPE_INET_PROTOCOL, TYPE_INET_SERVICE, TYPE_INTEGER, TYPE_IFNAME, TYPE_IPADDR, TYPE_MARK, TYPE_VERDICT, be_int,
    datatype, host_int, ipv4)
from agent.kernel.nftuapi import (
    FAMILIES, NF_NAT_RANGE_MAP_IPS, NF_NAT_RANGE_PROTO_RANDOM_FULLY, NF_NAT_RANGE_PROTO_SPECIFIED, NFT_CT_DST_IP,
    NFT_CT_MARK, NFT_CT_SRC_IP, NFT_LOOKUP_F_INV, NFT_META_IIFNAME, NFT_META_L4PROTO, NFT_META_MARK, NFT_META_OIFNAME,
    NFTA_MASQ_FLAGS, NFTA_MASQ_REG_PROTO_MIN,
    NFT_NAT_DNAT, NFT_NAT_SNAT, NFT_PAYLOAD_NETWORK_HEADER, NFT_PAYLOAD_TRANSPORT_HEADER, NFT_REG_VERDICT,
    NFT_SET_INTERVAL, NFTA_BITWISE_DREG, NFTA_BITWISE_LEN, NFTA_BITWISE_MASK, NFTA_BITWISE_OP, NFTA_BITWISE_SREG,
    NFTA_BITWISE_XOR, NFTA_CMP_DATA, NFTA_CMP_OP, NFTA_CMP_SREG, NFTA_COUNTER_BYTES, NFTA_COUNTER_PACKETS,
    NFTA_CT_DIRECTION, NFTA_CT_DREG, NFTA_CT_KEY, NFTA_CT_SREG, NFTA_DATA_VALUE, NFTA_DATA_VERDICT,
    NFTA_DYNSET_EXPR, NFTA_DYNSET_EXPRESSIONS, NFTA_DYNSET_FLAGS, NFTA_DYNSET_OP, NFTA_DYNSET_SET_NAME,
    NFTA_DYNSET_SREG_DATA, NFTA_DYNSET_SREG_KEY, NFTA_DYNSET_TIMEOUT, NFTA_EXPR_DATA, NFTA_EXPR_NAME,
    NFTA_IMMEDIATE_DATA, NFTA_IMMEDIATE_DREG, NFTA_LOOKUP_DREG, NFTA_LOOKUP_FLAGS, NFTA_LOOKUP_SET,
    NFTA_LOOKUP_SREG, NFTA_META_DREG, NFTA_META_KEY, NFTA_META_SREG, NFTA_NAT_FAMILY, NFTA_NAT_FLAGS,
    NFTA_NAT_REG_ADDR_MAX, NFTA_NAT_REG_ADDR_MIN, NFTA_NAT_REG_PROTO_MAX, NFTA_NAT_REG_PROTO_MIN, NFTA_NAT_TYPE,
    NFTA_HASH_DREG, NFTA_HASH_LEN, NFTA_HASH_MODULUS, NFTA_HASH_OFFSET, NFTA_HASH_SEED, NFTA_HASH_SET_ID,
    NFTA_HASH_SET_NAME, NFTA_HASH_SREG, NFTA_HASH_TYPE, NFT_HASH_JENKINS, NFTA_NG_DREG, NFTA_NG_MODULUS,
    NFTA_NG_OFFSET, NFTA_NG_TYPE, NFTA_PAYLOAD_BASE, NFTA_PAYLOAD_DREG,
    NFTA_PAYLOAD_LEN, NFTA_PAYLOAD_OFFSET, NFTA_PAYLOAD_SREG, NFTA_RULE_EXPRESSIONS, NFTA_RULE_USERDATA,
    NFTNL_UDATA_RULE_COMMENT)

Attrs = dict[int, bytes]  # one expression's attributes (NFTA_EXPR_DATA) by number


class _Opaque(Exception):
    """The rule cannot be rebuilt with certainty; the message says why."""


class _Operand:
    __slots__ = ("json", "length", "types", "kind", "used", "extra")

    def __init__(self, json: Any, length: int, types: tuple[int, ...], kind: str, extra: Any = None) -> None:
        self.json = json
        self.length = length
        self.types = types  # datatype ids of the value
        self.kind = kind  # "load", "numgen", "hash", "map", "imm"
        self.used = False
        self.extra = extra  # for "imm": the raw bytes


_PAYLOADS = {  # (base, offset, len) -> nft's name; ip family only
    (NFT_PAYLOAD_NETWORK_HEADER, 12, 4): ({"payload": {"protocol": "ip", "field": "saddr"}}, (TYPE_IPADDR,)),
    (NFT_PAYLOAD_NETWORK_HEADER, 16, 4): ({"payload": {"protocol": "ip", "field": "daddr"}}, (TYPE_IPADDR,)),
    (NFT_PAYLOAD_TRANSPORT_HEADER, 0, 2): ({"payload": {"protocol": "th", "field": "sport"}}, (TYPE_INET_SERVICE,)),
    (NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2): ({"payload": {"protocol": "th", "field": "dport"}}, (TYPE_INET_SERVICE,)),
}
_META = {NFT_META_L4PROTO: ({"meta": {"key": "l4proto"}}, 1, (TYPE_INET_PROTOCOL,)),
         NFT_META_MARK: ({"meta": {"key": "mark"}}, 4, (TYPE_MARK,)),
         NFT_META_IIFNAME: ({"meta": {"key": "iifname"}}, 16, (TYPE_IFNAME,)),
         NFT_META_OIFNAME: ({"meta": {"key": "oifname"}}, 16, (TYPE_IFNAME,))}
_META_SETTABLE = {NFT_META_MARK}  # meta mark set
_CT_KEYS = {NFT_CT_SRC_IP: "ip saddr", NFT_CT_DST_IP: "ip daddr"}  # of one direction: `ct original ip daddr`
_CT_DIRS = {0: "original", 1: "reply"}  # IP_CT_DIR_ORIGINAL, IP_CT_DIR_REPLY
_CT_MARK = {"ct": {"key": "mark"}}  # the connection's own (no direction): `ct mark`, `ct mark set ...`
_MARK_MASK = 0xFFFFFFFF
_CMP_OPS = {0: "==", 1: "!=", 2: "<", 3: "<=", 4: ">", 5: ">="}  # enum nft_cmp_ops: NFT_CMP_EQ..NFT_CMP_GTE
_NG_TYPES = {0: "inc", 1: "random"}  # enum nft_ng_types: NFT_NG_INCREMENTAL, NFT_NG_RANDOM
_DYNSET_OPS = {0: "add", 1: "update", 2: "delete"}  # enum nft_dynset_ops: NFT_DYNSET_OP_ADD..
_NAT_TYPES = {NFT_NAT_SNAT: "snat", NFT_NAT_DNAT: "dnat"}
_NAT_FLAGS = NF_NAT_RANGE_MAP_IPS | NF_NAT_RANGE_PROTO_SPECIFIED | NF_NAT_RANGE_PROTO_RANDOM_FULLY  # those decoded


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
        if info.flags & NFT_SET_INTERVAL or info.key_types != (TYPE_INTEGER,):
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

    def run(self, exprs: list[tuple[str, Attrs]]) -> list[Any]:
        for name, a in exprs:
            handler = _EXPRESSIONS.get(name)
            if handler is None:
                raise _Opaque(f"expression {name}")
            handler(self, a)
        for v in self.regs.values():
            if isinstance(v, _Operand) and not v.used:
                raise _Opaque("value loaded and not used")
        if not self.stmts:
            raise _Opaque("no statement")
        return self.stmts

    # expressions (dispatched through _EXPRESSIONS below) ---------------------------------
    def payload(self, a: Attrs) -> None:
        if NFTA_PAYLOAD_SREG in a or NFTA_PAYLOAD_DREG not in a:  # a payload write
            raise _Opaque("payload write")
        base, off, ln = (nl.get_be32(a[i]) for i in (NFTA_PAYLOAD_BASE, NFTA_PAYLOAD_OFFSET, NFTA_PAYLOAD_LEN))
        known = _PAYLOADS.get((base, off, ln)) if self.family == FAMILIES["ip"] else None
        if known is None:
            raise _Opaque(f"payload base {base} offset {off} len {ln}")
        if base == NFT_PAYLOAD_TRANSPORT_HEADER and self.l4proto_cmp:
            raise _Opaque("transport header after a protocol match (nft lists it as the protocol's field)")
        self.load(nl.get_be32(a[NFTA_PAYLOAD_DREG]), _Operand(known[0], ln, known[1], "load"))

    def meta(self, a: Attrs) -> None:
        key = nl.get_be32(a[NFTA_META_KEY])
        known = _META.get(key)
        if known is None:
            raise _Opaque(f"meta key {key}")
        if NFTA_META_SREG in a:  # `meta mark set <value>`
            if key not in _META_SETTABLE:
                raise _Opaque(f"meta set of key {key}")
            value = self.take(nl.get_be32(a[NFTA_META_SREG]), known[1])
            self.stmts.append({"mangle": {"key": known[0], "value": self.key_json(value)}})
            return
        if NFTA_META_DREG not in a:
            raise _Opaque("meta without a register")
        self.load(nl.get_be32(a[NFTA_META_DREG]), _Operand(known[0], known[1], known[2], "load"))

    def bitwise(self, a: Attrs) -> None:
        """`mark & M` and `mark | X`, as nft writes them (mask and xor over a mark)."""
        if nl.get_be32(a[NFTA_BITWISE_OP]) if NFTA_BITWISE_OP in a else 0:  # NFT_BITWISE_BOOL is 0
            raise _Opaque("bitwise shift or register operation")
        length = nl.get_be32(a[NFTA_BITWISE_LEN])
        parts = self.take(nl.get_be32(a[NFTA_BITWISE_SREG]), length)
        if len(parts) != 1 or parts[0].types != (TYPE_MARK,) or length != 4:
            raise _Opaque("bitwise beyond a mark")
        mask, xor = (host_int(nl.attrs(a[i])[NFTA_DATA_VALUE]) for i in (NFTA_BITWISE_MASK, NFTA_BITWISE_XOR))
        if xor == 0:
            json: Any = {"&": [parts[0].json, mask]}
        elif mask | xor == _MARK_MASK and not mask & xor:
            json = {"|": [parts[0].json, xor]}
        else:
            raise _Opaque("bitwise form")
        self.load(nl.get_be32(a[NFTA_BITWISE_DREG]), _Operand(json, 4, (TYPE_MARK,), "load"))

    def ct(self, a: Attrs) -> None:
        key = nl.get_be32(a[NFTA_CT_KEY])
        if key == NFT_CT_MARK and NFTA_CT_DIRECTION not in a:
            if NFTA_CT_SREG in a:  # `ct mark set <value>`
                value = self.take(nl.get_be32(a[NFTA_CT_SREG]), 4)
                self.stmts.append({"mangle": {"key": _CT_MARK, "value": self.key_json(value)}})
            elif NFTA_CT_DREG in a:
                self.load(nl.get_be32(a[NFTA_CT_DREG]), _Operand(_CT_MARK, 4, (TYPE_MARK,), "load"))
            else:
                raise _Opaque("ct mark without a register")
            return
        if NFTA_CT_SREG in a or NFTA_CT_DREG not in a:
            raise _Opaque("ct set")
        direction = a[NFTA_CT_DIRECTION][0] if NFTA_CT_DIRECTION in a else None  # a u8
        name = _CT_KEYS.get(key)
        if name is None or direction not in _CT_DIRS:
            raise _Opaque(f"ct key {key}")
        self.load(nl.get_be32(a[NFTA_CT_DREG]),
                  _Operand({"ct": {"key": name, "dir": _CT_DIRS[direction]}}, 4, (TYPE_IPADDR,), "load"))

    def numgen(self, a: Attrs) -> None:
        mode = _NG_TYPES.get(nl.get_be32(a[NFTA_NG_TYPE]) if NFTA_NG_TYPE in a else 0)
        if mode is None:
            raise _Opaque("numgen mode")
        offset = nl.get_be32(a[NFTA_NG_OFFSET]) if NFTA_NG_OFFSET in a else 0
        self.load(nl.get_be32(a[NFTA_NG_DREG]), _Operand(
            {"numgen": {"mode": mode, "mod": nl.get_be32(a[NFTA_NG_MODULUS]), "offset": offset}}, 4,
            (TYPE_INTEGER,), "numgen"))

    def hash(self, a: Attrs) -> None:
        """`jhash <expr> mod M [seed S] [offset O]` (symhash and the obsolete set forms are
        left opaque). The seed is listed only when the rule gave one: without it the kernel
        drew its own, which it does not dump."""
        kind = nl.get_be32(a[NFTA_HASH_TYPE]) if NFTA_HASH_TYPE in a else NFT_HASH_JENKINS
        if kind != NFT_HASH_JENKINS or NFTA_HASH_SET_NAME in a or NFTA_HASH_SET_ID in a:
            raise _Opaque(f"hash type {kind}")
        parts = self.take(nl.get_be32(a[NFTA_HASH_SREG]), nl.get_be32(a[NFTA_HASH_LEN]))
        if len(parts) != 1 or parts[0].kind != "load":
            raise _Opaque("hash of a composite value")
        body: dict[str, Any] = {"mod": nl.get_be32(a[NFTA_HASH_MODULUS])}
        if NFTA_HASH_SEED in a:
            body["seed"] = nl.get_be32(a[NFTA_HASH_SEED])
        if offset := nl.get_be32(a[NFTA_HASH_OFFSET]) if NFTA_HASH_OFFSET in a else 0:
            body["offset"] = offset
        body["expr"] = parts[0].json
        self.load(nl.get_be32(a[NFTA_HASH_DREG]), _Operand({"jhash": body}, 4, (TYPE_INTEGER,), "hash"))

    def immediate(self, a: Attrs) -> None:
        dreg = nl.get_be32(a[NFTA_IMMEDIATE_DREG])
        data = nl.attrs(a[NFTA_IMMEDIATE_DATA])
        if dreg == NFT_REG_VERDICT:
            if NFTA_DATA_VERDICT not in data:
                raise _Opaque("immediate to the verdict register without a verdict")
            v = verdict(data[NFTA_DATA_VERDICT])
            if "opaque" in v:
                raise _Opaque(v["opaque"])
            target = next(iter(v.values()))
            if isinstance(target, dict) and target.get("target") in self.bindings:
                raise _Opaque("jump to an anonymous chain (nft lists it inline)")
            self.stmts.append(v)
            return
        raw = data.get(NFTA_DATA_VALUE)
        if raw is None:
            raise _Opaque("immediate without a value")
        self.load(dreg, _Operand(None, len(raw), (), "imm", raw))

    def cmp(self, a: Attrs) -> None:
        op = _CMP_OPS.get(nl.get_be32(a[NFTA_CMP_OP]))
        raw = nl.attrs(a[NFTA_CMP_DATA]).get(NFTA_DATA_VALUE)
        if op is None or raw is None:
            raise _Opaque("cmp")
        parts = self.take(nl.get_be32(a[NFTA_CMP_SREG]), len(raw))
        left = parts[0]
        if len(parts) != 1 or len(left.types) != 1 or left.kind != "load":
            raise _Opaque("cmp of a composite value")
        t = datatype(left.types[0])
        if t.decode is None or t.size != len(raw):
            raise _Opaque("cmp value type")
        if left.json == {"meta": {"key": "l4proto"}}:
            self.l4proto_cmp = True
        self.stmts.append({"match": {"op": op, "left": left.json, "right": t.decode(raw)}})

    def lookup(self, a: Attrs) -> None:
        name = nl.get_str(a[NFTA_LOOKUP_SET])
        info = self.sets.get(name)
        if info is None:
            raise _Opaque(f"lookup in unknown set {name}")
        flags = nl.get_be32(a[NFTA_LOOKUP_FLAGS]) if NFTA_LOOKUP_FLAGS in a else 0
        if flags & ~NFT_LOOKUP_F_INV:
            raise _Opaque("lookup flags")
        key = self.key_json(self.take(nl.get_be32(a[NFTA_LOOKUP_SREG]), info.key_len))
        dreg = nl.get_be32(a[NFTA_LOOKUP_DREG]) if NFTA_LOOKUP_DREG in a else None
        if dreg is None:
            if info.is_map:
                raise _Opaque("lookup in a map without a result")
            if info.anonymous:
                raise _Opaque("match against an anonymous set")
            self.stmts.append({"match": {"op": "!=" if flags & NFT_LOOKUP_F_INV else "==", "left": key,
                                         "right": self.set_ref(name, info)}})
            return
        if flags & NFT_LOOKUP_F_INV or not info.is_map:
            raise _Opaque("inverted or set lookup with a result")
        ref = self.set_ref(name, info)
        if dreg == NFT_REG_VERDICT:
            if info.data_types != (TYPE_VERDICT,):
                raise _Opaque("verdict lookup in a data map")
            self.stmts.append({"vmap": {"key": key, "data": ref}})
            return
        self.load(dreg, _Operand({"map": {"key": key, "data": ref}}, info.data_len, info.data_types, "map"))

    def nat(self, a: Attrs) -> None:
        kind = _NAT_TYPES.get(nl.get_be32(a[NFTA_NAT_TYPE]))
        family = nl.get_be32(a[NFTA_NAT_FAMILY]) if NFTA_NAT_FAMILY in a else 0
        flags = nl.get_be32(a[NFTA_NAT_FLAGS]) if NFTA_NAT_FLAGS in a else 0
        if kind is None or family != FAMILIES["ip"] or flags & ~_NAT_FLAGS:
            raise _Opaque("nat beyond address and port")
        amin, amax = (nl.get_be32(a[i]) if i in a else None for i in (NFTA_NAT_REG_ADDR_MIN, NFTA_NAT_REG_ADDR_MAX))
        pmin, pmax = (nl.get_be32(a[i]) if i in a else None for i in (NFTA_NAT_REG_PROTO_MIN, NFTA_NAT_REG_PROTO_MAX))
        if amin is None or (amax not in (None, amin)) or (pmax not in (None, pmin)):
            raise _Opaque("nat with ranges")
        r = _reg32(amin)
        addr = self.regs.get(r)
        if not isinstance(addr, _Operand):
            raise _Opaque("nat address from an unset register")
        if addr.kind == "load" and addr.types == (TYPE_IPADDR,) and pmin is None and flags & NF_NAT_RANGE_MAP_IPS:
            addr.used = True  # an address from the packet or conntrack: `snat to ct original ip daddr`
            stmt = {"family": "ip", "addr": addr.json}
            if flags & NF_NAT_RANGE_PROTO_RANDOM_FULLY:
                stmt["flags"] = ["fully-random"]
            self.stmts.append({kind: stmt})
            return
        if flags & NF_NAT_RANGE_PROTO_RANDOM_FULLY:
            raise _Opaque("nat flags")
        if addr.kind == "map" and addr.types == (TYPE_IPADDR, TYPE_INET_SERVICE) and pmin is not None \
                and _reg32(pmin) == r + 1 and flags == NF_NAT_RANGE_MAP_IPS | NF_NAT_RANGE_PROTO_SPECIFIED:
            addr.used = True  # address and port from one map of concatenated data
            self.stmts.append({kind: {"family": "ip", "addr": addr.json}})
            return
        if addr.kind == "imm" and addr.length == 4 and flags & NF_NAT_RANGE_MAP_IPS:  # constants: `dnat to a.b.c.d:p`
            body: dict[str, Any] = {"addr": ipv4(addr.extra)}
            addr.used = True
            if pmin is not None:
                port = self.regs.get(_reg32(pmin))
                if not isinstance(port, _Operand) or port.kind != "imm" or port.length != 2 \
                        or not flags & NF_NAT_RANGE_PROTO_SPECIFIED:
                    raise _Opaque("nat port form")
                port.used = True
                body["port"] = be_int(port.extra)
            elif flags & NF_NAT_RANGE_PROTO_SPECIFIED:
                raise _Opaque("nat port flag without a port")
            self.stmts.append({kind: body})
            return
        raise _Opaque("nat form")

    def masq(self, a: Attrs) -> None:
        """`masquerade` (to the outgoing interface's address), with `fully-random` or none."""
        flags = nl.get_be32(a[NFTA_MASQ_FLAGS]) if NFTA_MASQ_FLAGS in a else 0
        if NFTA_MASQ_REG_PROTO_MIN in a or flags & ~NF_NAT_RANGE_PROTO_RANDOM_FULLY:
            raise _Opaque("masquerade with ports or flags beyond fully-random")
        self.stmts.append({"masquerade": {"flags": ["fully-random"]} if flags else None})

    def dynset(self, a: Attrs) -> None:
        op = _DYNSET_OPS.get(nl.get_be32(a[NFTA_DYNSET_OP]))
        name = nl.get_str(a[NFTA_DYNSET_SET_NAME])
        info = self.sets.get(name)
        if op is None or info is None or info.anonymous:
            raise _Opaque("dynset")
        if NFTA_DYNSET_SREG_DATA in a or NFTA_DYNSET_EXPR in a or NFTA_DYNSET_EXPRESSIONS in a or \
                (NFTA_DYNSET_FLAGS in a and nl.get_be32(a[NFTA_DYNSET_FLAGS])):
            raise _Opaque("dynset with data or statements")
        key = self.key_json(self.take(nl.get_be32(a[NFTA_DYNSET_SREG_KEY]), info.key_len))
        elem: Any = key
        ms = nl.get_be64(a[NFTA_DYNSET_TIMEOUT]) if NFTA_DYNSET_TIMEOUT in a else 0
        if ms:  # 0: the set's own timeout (nft lists no timeout)
            if ms % 1000:
                raise _Opaque("dynset timeout in milliseconds")
            elem = {"elem": {"val": key, "timeout": ms // 1000}}
        self.stmts.append({"set": {"op": op, "elem": elem, "set": f"@{name}"}})

    def counter(self, a: Attrs) -> None:
        packets = nl.get_be64(a[NFTA_COUNTER_PACKETS]) if NFTA_COUNTER_PACKETS in a else 0
        nbytes = nl.get_be64(a[NFTA_COUNTER_BYTES]) if NFTA_COUNTER_BYTES in a else 0
        self.stmts.append({"counter": {"packets": packets, "bytes": nbytes}})


# Each expression the decompiler knows (its NFTA_EXPR_NAME) -> its handler; any other makes the rule opaque.
_EXPRESSIONS: dict[str, Callable[[_Rule, Attrs], None]] = {
    "payload": _Rule.payload, "meta": _Rule.meta, "bitwise": _Rule.bitwise, "ct": _Rule.ct,
    "numgen": _Rule.numgen, "hash": _Rule.hash, "immediate": _Rule.immediate, "cmp": _Rule.cmp,
    "lookup": _Rule.lookup,
    "nat": _Rule.nat, "masq": _Rule.masq, "dynset": _Rule.dynset, "counter": _Rule.counter,
}


def rule_expressions(buf: bytes) -> list[tuple[str, Attrs]]:
    """(name, attributes) of each expression in an NFTA_RULE_EXPRESSIONS nest, in order."""
    out = []
    for _t, v in nl.attr_list(buf):
        e = nl.attrs(v)
        out.append((nl.get_str(e.get(NFTA_EXPR_NAME, b"")), nl.attrs(e[NFTA_EXPR_DATA]) if NFTA_EXPR_DATA in e else {}))
    return out


def decode_rule(attrs: Mapping[int, bytes], family: int, sets: Mapping[str, SetInfo],
                anon: Mapping[str, list[Element]], bindings: Iterable[str] = ()) -> dict[str, Any]:
    """An NFT_MSG_NEWRULE message's attributes -> {"expr": [...]} (+ "comment"); never raises."""
    rule: dict[str, Any]
    try:
        exprs = rule_expressions(attrs.get(NFTA_RULE_EXPRESSIONS, b""))
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
        ud = udata(attrs.get(NFTA_RULE_USERDATA, b""))
        if NFTNL_UDATA_RULE_COMMENT in ud:
            rule["comment"] = nl.get_str(ud[NFTNL_UDATA_RULE_COMMENT])
    except (ValueError, IndexError):
        pass
    return rule
