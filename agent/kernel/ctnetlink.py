"""Conntrack over netlink (ctnetlink): the entries toward an address, and deletes in
batches. The agent's only conntrack edge; no process per entry: the conntrack tool, one
process per removed identity, held the loop 24 s for 2,000 identities.

A dump asks the kernel to filter by the original tuple's destination and protocol (and
port) (CTA_FILTER, Linux 5.8+), so it costs what lies toward the agent's identities, not
the whole table; a kernel without it ignores the filter and sends everything, which
`flows()` filters itself (`filtered` tells which happened: the kernel flags a filtered
dump's messages NLM_F_DUMP_FILTERED). A delete names the entry's kernel id as well as its
tuple, so an entry that was replaced meanwhile by a new one with the same tuple stays.

Why not pyroute2's conntrack: it decodes every attribute of every entry into objects;
this reads only the fields the decision and a delete need, on the codec agent/kernel/nfnetlink.py
already has (bench/cleanup.py, 20,000 entries: ~91,000 decoded a second here, pyroute2
3,600-6,200). Constants: linux/netfilter/nfnetlink_conntrack.h."""
from __future__ import annotations

import errno
import socket
import struct
from typing import Iterator, Sequence

from agent.kernel import nfnetlink as nl
from agent.core.flows import Flow, Query

IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE = 1, 2
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_ID, CTA_ZONE, CTA_FILTER = 1, 2, 12, 18, 25
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST = 1, 2
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_FILTER_ORIG_FLAGS = 1
FILTER_IP_DST, FILTER_PROTO_NUM, FILTER_PROTO_DST_PORT = 1 << 1, 1 << 3, 1 << 5
AF_INET = 2
DELETE_BATCH = 256  # deletes per datagram: ~90 bytes each, well inside a default send buffer

_U32 = struct.Struct("=I")  # CTA_FILTER's flags are in host order


class Conntrack(nl.NfSocket):
    """One ctnetlink socket in the network namespace of the thread that creates it."""

    def __init__(self, timeout: float = 10.0) -> None:
        super().__init__(timeout=timeout, subsys=nl.NFNL_SUBSYS_CTNETLINK)
        self.filtered: bool | None = None  # did the kernel filter the last dump (None: it sent nothing)
        self.dumped = 0  # entries the kernel sent, all dumps so far (more than asked for: no kernel filter)

    def flows(self, query: Query) -> Iterator[Flow]:
        """The IPv4 entries whose original destination matches the query."""
        dump = self.dump(IPCTNL_MSG_CT_GET, AF_INET, filter_attrs(query))
        self.filtered = None
        for m in dump:
            self.dumped += 1
            if self.filtered is None:
                self.filtered = bool(m.flags & nl.NLM_F_DUMP_FILTERED)
            flow = decode(m)
            if flow is not None and flow.dst == query.eip and flow.proto == query.proto \
                    and (query.port is None or flow.dport == query.port):
                yield flow

    def delete(self, flows: Sequence[Flow]) -> int:
        """Delete these entries; how many went (one already gone is not counted). Raises
        NetlinkError when the kernel refuses for another reason than absence."""
        deleted = 0
        for start in range(0, len(flows), DELETE_BATCH):
            chunk = flows[start:start + DELETE_BATCH]
            codes = self.batch(IPCTNL_MSG_CT_DELETE, AF_INET, [delete_attrs(f) for f in chunk])
            for code in codes:
                if code == 0:
                    deleted += 1
                elif code != errno.ENOENT:
                    raise nl.NetlinkError(code, "conntrack delete")
        return deleted


def _tuple(ip: list[bytes], ports: list[bytes]) -> bytes:
    return nl.attr_nested(CTA_TUPLE_ORIG, [nl.attr_nested(CTA_TUPLE_IP, ip), nl.attr_nested(CTA_TUPLE_PROTO, ports)])


def filter_attrs(query: Query) -> list[bytes]:
    """A dump request's attributes: the original tuple's destination, protocol and port,
    and CTA_FILTER saying which of them to match."""
    ports = [nl.attr_bytes(CTA_PROTO_NUM, bytes([query.proto]))]
    flags = FILTER_IP_DST | FILTER_PROTO_NUM
    if query.port is not None:
        ports.append(nl.attr_bytes(CTA_PROTO_DST_PORT, nl.BE16.pack(query.port)))
        flags |= FILTER_PROTO_DST_PORT
    return [_tuple([nl.attr_bytes(CTA_IP_V4_DST, socket.inet_aton(query.eip))], ports),
            nl.attr_nested(CTA_FILTER, [nl.attr_bytes(CTA_FILTER_ORIG_FLAGS, _U32.pack(flags))])]


def delete_attrs(flow: Flow) -> bytes:
    parts = [_tuple([nl.attr_bytes(CTA_IP_V4_SRC, socket.inet_aton(flow.src)),
                     nl.attr_bytes(CTA_IP_V4_DST, socket.inet_aton(flow.dst))],
                    [nl.attr_bytes(CTA_PROTO_NUM, bytes([flow.proto])),
                     nl.attr_bytes(CTA_PROTO_SRC_PORT, nl.BE16.pack(flow.sport)),
                     nl.attr_bytes(CTA_PROTO_DST_PORT, nl.BE16.pack(flow.dport))])]
    if flow.zone:
        parts.append(nl.attr_bytes(CTA_ZONE, nl.BE16.pack(flow.zone)))
    if flow.id is not None:
        parts.append(nl.attr_be32(CTA_ID, flow.id))
    return b"".join(parts)


def decode(m: nl.Message) -> Flow | None:
    """One IPCTNL_MSG_CT_NEW message of a dump -> Flow (None: not an IPv4 TCP/UDP entry,
    or malformed)."""
    try:
        orig = reply = None
        ident, zone = None, 0
        buf = m.buf
        for t, a, b in nl.iter_attrs(buf, m.start, m.end):
            if t == CTA_TUPLE_ORIG:
                orig = _decode_tuple(buf, a, b)
            elif t == CTA_TUPLE_REPLY:
                reply = _decode_tuple(buf, a, b)
            elif t == CTA_ID:
                ident = nl.get_be32(buf[a:b])
            elif t == CTA_ZONE:
                zone = nl.get_be16(buf[a:b])
        if orig is None or reply is None or None in orig or reply[0] is None or reply[3] is None:
            return None  # not TCP or UDP over IPv4 (no ports), or incomplete
        return Flow(orig[2], orig[0], orig[3], orig[1], orig[4], reply[0], reply[3], ident, zone)
    except (nl.MalformedError, struct.error, IndexError):
        return None


def _decode_tuple(buf: bytes, start: int, end: int) -> tuple:
    """(src, dst, proto, sport, dport) of a CTA_TUPLE_*; None where absent."""
    src = dst = proto = sport = dport = None
    for t, a, b in nl.iter_attrs(buf, start, end):
        if t == CTA_TUPLE_IP:
            for u, x, y in nl.iter_attrs(buf, a, b):
                if u == CTA_IP_V4_SRC and y - x == 4:
                    src = socket.inet_ntoa(buf[x:y])
                elif u == CTA_IP_V4_DST and y - x == 4:
                    dst = socket.inet_ntoa(buf[x:y])
        elif t == CTA_TUPLE_PROTO:
            for u, x, y in nl.iter_attrs(buf, a, b):
                if u == CTA_PROTO_NUM:
                    proto = buf[x]
                elif u == CTA_PROTO_SRC_PORT:
                    sport = nl.BE16.unpack_from(buf, x)[0]
                elif u == CTA_PROTO_DST_PORT:
                    dport = nl.BE16.unpack_from(buf, x)[0]
    return src, dst, proto, sport, dport
