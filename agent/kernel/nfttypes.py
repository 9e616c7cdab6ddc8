"""nftables datatypes and the decoders of set keys and map data: a set declares its key's
(and a map its data's) datatype ids, a concatenation packing them 6 bits each; the bytes
of each element decode by them into the values render.py writes."""
from __future__ import annotations

import socket
import struct
import sys
from typing import Any, Callable, NamedTuple

from agent.core.ruleset import ElemKey
from agent.kernel import nfnetlink as nl
from agent.kernel.nftuapi import NFT_DATA_VERDICT

# nftables' include/datatype.h: enum datatypes (only those named below by the decoders)
TYPE_VERDICT, TYPE_INTEGER, TYPE_IPADDR = 1, 4, 7
TYPE_INET_PROTOCOL, TYPE_INET_SERVICE, TYPE_MARK, TYPE_IFNAME = 12, 13, 19, 41

# /etc/protocols names as nft prints them (getprotobynumber); others print as numbers
PROTOS = {1: "icmp", 2: "igmp", 6: "tcp", 17: "udp", 33: "dccp", 47: "gre", 50: "esp", 51: "ah",
          132: "sctp", 136: "udplite"}


def ipv4(b: bytes) -> str:
    return f"{b[0]}.{b[1]}.{b[2]}.{b[3]}"


def _ipv6(b: bytes) -> str:
    return socket.inet_ntop(socket.AF_INET6, b)


def _proto(b: bytes) -> Any:
    return PROTOS.get(b[0], b[0])


def be_int(b: bytes) -> int:
    return int.from_bytes(b, "big")


def _ether(b: bytes) -> str:
    return ":".join(f"{x:02x}" for x in b)


def _ifname(b: bytes) -> str:
    return nl.get_str(b)


def host_int(b: bytes) -> int:
    """A mark: nft keeps it in the host's byte order."""
    return int.from_bytes(b, sys.byteorder)


class Datatype(NamedTuple):
    name: str
    size: int | None  # bytes; None: the set's key length says
    decode: Callable[[bytes], Any] | None  # None: not decoded with certainty (hex marker)


_TYPES: dict[int, Datatype] = {
    TYPE_VERDICT: Datatype("verdict", None, None), 2: Datatype("nf_proto", 1, None),
    3: Datatype("bitmask", None, None), TYPE_INTEGER: Datatype("integer", None, None),
    5: Datatype("string", None, None), 6: Datatype("ll_addr", None, None),
    TYPE_IPADDR: Datatype("ipv4_addr", 4, ipv4), 8: Datatype("ipv6_addr", 16, _ipv6),
    9: Datatype("ether_addr", 6, _ether), 10: Datatype("ether_type", 2, None),
    TYPE_INET_PROTOCOL: Datatype("inet_proto", 1, _proto), TYPE_INET_SERVICE: Datatype("inet_service", 2, be_int),
    TYPE_MARK: Datatype("mark", 4, host_int), TYPE_IFNAME: Datatype("ifname", 16, _ifname),
}


def datatype(tid: int) -> Datatype:
    return _TYPES.get(tid) or Datatype(f"type_{tid}", None, None)


def split_concat(type_id: int) -> list[int]:
    """Component datatype ids of a (possibly concatenated) NFTA_SET_KEY_TYPE, first first."""
    if type_id == NFT_DATA_VERDICT:
        return [TYPE_VERDICT]
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


def value_decoder(types: list[int], total: int, host_order: bool = False) -> Callable[[bytes], Any]:
    """bytes -> tuple of component values (one per type), for keys and map data. A
    component of a type decoded without certainty becomes a hex string, which never
    equals what the agent renders."""
    if len(types) == 1:
        t = datatype(types[0])
        if types[0] == TYPE_INTEGER:
            dec = _int_decoder(host_order)
        elif t.decode is None or (t.size is not None and t.size != total):
            dec = _hex
        else:
            dec = t.decode
        return lambda b: (dec(b),)
    sizes = [datatype(t).size for t in types]
    if None in sizes or sum((s + 3) & ~3 for s in sizes) != total:  # type: ignore[operator]
        return lambda b: (_hex(b),)
    plan = []
    off = 0
    for t, s in zip(types, sizes, strict=True):
        d = datatype(t).decode or _hex
        plan.append((off, off + s, d))  # type: ignore[operator]
        off += (s + 3) & ~3  # type: ignore[operator]
    # The agent's own shapes, one struct call each (50,000 elements at 10k x 4):
    if types == [TYPE_IPADDR, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]:  # identity key: address . protocol . port
        fmt = struct.Struct("!4BB3xH2x")

        def identity(b: bytes) -> ElemKey:
            a0, a1, a2, a3, p, port = fmt.unpack(b)
            return (f"{a0}.{a1}.{a2}.{a3}", PROTOS.get(p, p), port)
        return identity
    if types == [TYPE_IPADDR, TYPE_INET_SERVICE]:  # backend data: address . port
        pair = struct.Struct("!4BH2x")

        def backend(b: bytes) -> tuple[Any, ...]:
            a0, a1, a2, a3, port = pair.unpack(b)
            return (f"{a0}.{a1}.{a2}.{a3}", port)
        return backend
    return lambda b: tuple(d(b[x:y]) for x, y, d in plan)
