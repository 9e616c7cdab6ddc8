"""The rule decompiler's register tracking (agent/kernel/nftrule.py) on hand-built
expressions, and the datatype ids of concatenations (agent/kernel/nfttypes.py)."""
from __future__ import annotations

import struct
from typing import Any

from agent.kernel import nfnetlink as nl
from agent.kernel import nftuapi as uapi
from agent.kernel.nftobjects import decode_sets
from agent.kernel.nftrule import decode_rule
from agent.kernel.nfttypes import split_concat
from tests.netlinkfx import FIXTURES, IP, is_opaque, load, messages


def test_concatenated_type_ids_split_six_bits_each() -> None:
    assert split_concat(7 << 12 | 12 << 6 | 13) == [7, 12, 13]
    assert split_concat(7) == [7]
    assert split_concat(uapi.NFT_DATA_VERDICT) == [1]


# --- register tracking, on hand-built expressions -----------------------------------------------

def _expr(name: str, **attrs: bytes) -> bytes:
    data = b"".join(nl.attr_bytes(int(k[1:]), v) for k, v in attrs.items())
    return nl.attr_nested(uapi.NFTA_LIST_ELEM, [nl.attr_str(uapi.NFTA_EXPR_NAME, name),
                                              nl.attr_nested(uapi.NFTA_EXPR_DATA, [data])])


def _be(v: int) -> bytes:
    return struct.pack("!I", v)


def _rule(*exprs: bytes) -> dict[str, Any]:
    fx = load(FIXTURES[0])
    infos = decode_sets(messages(fx["tables"]["ip natgw"]["dumps"]["sets"]))
    a = {uapi.NFTA_RULE_EXPRESSIONS: b"".join(exprs)}
    return decode_rule(a, IP, infos, {})


def _daddr(reg: int) -> bytes:
    return _expr("payload", a1=_be(reg), a2=_be(1), a3=_be(16), a4=_be(4))


def _l4proto(reg: int) -> bytes:
    return _expr("meta", a2=_be(16), a1=_be(reg))


def _dport(reg: int) -> bytes:
    return _expr("payload", a1=_be(reg), a2=_be(2), a3=_be(2), a4=_be(2))


def _vmap(sreg: int, name: str = "services") -> bytes:
    return _expr("lookup", a1=name.encode() + b"\0", a2=_be(sreg), a3=_be(0))


DISPATCH = {"expr": [{"vmap": {"key": {"concat": [{"payload": {"protocol": "ip", "field": "daddr"}},
                                                  {"meta": {"key": "l4proto"}},
                                                  {"payload": {"protocol": "th", "field": "dport"}}]},
                               "data": "@services"}}]}


def test_16_byte_and_32_bit_register_names_alias() -> None:
    assert _rule(_daddr(1), _l4proto(9), _dport(10), _vmap(1)) == DISPATCH  # as nft writes it
    assert _rule(_daddr(8), _l4proto(9), _dport(10), _vmap(8)) == DISPATCH  # NFT_REG32_00 for NFT_REG_1
    assert _rule(_daddr(2), _l4proto(13), _dport(14), _vmap(2)) == DISPATCH  # NFT_REG_2 = NFT_REG32_04


def test_register_mistakes_make_a_rule_opaque() -> None:
    assert is_opaque(_rule(_daddr(1), _dport(10), _vmap(1)))  # a gap: key is 12 bytes, 8 loaded
    assert is_opaque(_rule(_daddr(1), _l4proto(9), _dport(11), _vmap(1)))  # components not adjacent
    assert is_opaque(_rule(_daddr(1), _l4proto(9), _dport(10), _daddr(12), _vmap(1)))  # a load never used
    assert is_opaque(_rule(_daddr(1), _daddr(1), _l4proto(9), _dport(10), _vmap(1)))  # overwritten unused
    assert is_opaque(_rule(_l4proto(9), _dport(10), _vmap(1)))  # reads an unset register
    assert is_opaque(_rule(_vmap(1, "nosuchset")))
    assert is_opaque(_rule(_expr("ct", a1=_be(1), a2=_be(0))))


# --- the connection's mark and masquerade (--masquerade), encoded as nft 1.0.6 and 1.1.x do ------

def _data(v: bytes) -> bytes:
    return nl.attr_nested(0, [nl.attr_bytes(uapi.NFTA_DATA_VALUE, v)])[4:]  # the nest's payload


def _ct_mark(reg: int, store: bool = False) -> bytes:
    return _expr("ct", a2=_be(uapi.NFT_CT_MARK), **{("a4" if store else "a1"): _be(reg)})


def _bitwise(mask: int, xor: int) -> bytes:
    return _expr("bitwise", a1=_be(1), a2=_be(1), a3=_be(4), a4=_data(struct.pack("=I", mask)),
                 a5=_data(struct.pack("=I", xor)))


CT_MARK = {"ct": {"key": "mark"}}


def test_the_connections_mark_and_masquerade_read_back_as_rendered() -> None:
    from agent.core.render import Snat, base_ruleset, _slot

    snat = Snat("eth0", masquerade=0x4000)
    set_bit = _rule(_ct_mark(1), _bitwise(0xFFFFFFFF & ~0x4000, 0x4000), _ct_mark(1, store=True))
    assert set_bit == _slot(0, snat)["slot_0"].rules[0]  # ct mark set ct mark | 0x4000
    oifname = _expr("meta", a2=_be(uapi.NFT_META_OIFNAME), a1=_be(1))
    eth0 = _expr("cmp", a1=_be(1), a2=_be(0), a3=_data(b"eth0".ljust(16, b"\0")))
    marked = (_ct_mark(1), _bitwise(0x4000, 0), _expr("cmp", a1=_be(1), a2=_be(0), a3=_data(struct.pack("=I", 0x4000))))
    masq = _rule(oifname, eth0, *marked, _expr("masq", a1=_be(0x10)))
    assert masq == base_ruleset(-160, snat).rules["postrouting"][0]
    assert _rule(oifname, eth0, *marked, _expr("masq"))["expr"][-1] == {"masquerade": None}
    assert is_opaque(_rule(*marked, _expr("masq", a1=_be(0x10), a2=_be(1))))  # a port range: not the agent's
    assert is_opaque(_rule(*marked, _expr("masq", a1=_be(0x4))))  # other flags
    assert is_opaque(_rule(_expr("ct", a2=_be(uapi.NFT_CT_MARK), a1=_be(1), a3=b"\x00"), _bitwise(0x4000, 0),
                           _ct_mark(1, store=True)))  # a direction: not the connection's own mark
