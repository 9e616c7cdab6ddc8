"""agent/kernel/ctnetlink.py's codec on messages built the way the kernel builds them
(ctnetlink_fill_info's attribute layout); the kernel itself is in
netns-tests/test_conntrack_kernel.py."""
from __future__ import annotations

import socket
import struct

from agent.kernel import ctnetlink as ct
from agent.kernel import nfnetlink as nl
from agent.core.flows import Flow, Query


def _tuple(typ: int, src: str, dst: str, proto: int, sport: int, dport: int) -> bytes:
    return nl.attr_nested(typ, [
        nl.attr_nested(ct.CTA_TUPLE_IP, [nl.attr_bytes(ct.CTA_IP_V4_SRC, socket.inet_aton(src)),
                                         nl.attr_bytes(ct.CTA_IP_V4_DST, socket.inet_aton(dst))]),
        nl.attr_nested(ct.CTA_TUPLE_PROTO, [nl.attr_bytes(ct.CTA_PROTO_NUM, bytes([proto])),
                                            nl.attr_bytes(ct.CTA_PROTO_SRC_PORT, struct.pack("!H", sport)),
                                            nl.attr_bytes(ct.CTA_PROTO_DST_PORT, struct.pack("!H", dport))])])


def entry(zone: int = 0) -> nl.Message:
    payload = (_tuple(ct.CTA_TUPLE_ORIG, "172.18.0.100", "172.18.0.10", 17, 40000, 53)
               + _tuple(ct.CTA_TUPLE_REPLY, "10.0.1.11", "172.18.0.100", 17, 5353, 40000)
               + nl.attr_be32(3, 0x18E)  # CTA_STATUS: read by nothing here
               + nl.attr_be32(ct.CTA_ID, 123456)
               + (nl.attr_bytes(ct.CTA_ZONE, struct.pack("!H", zone)) if zone else b""))
    raw = nl.build_message(nl.NFNL_SUBSYS_CTNETLINK << 8, nl.NLM_F_MULTI | nl.NLM_F_DUMP_FILTERED, 1, 2, payload)
    return next(nl.split_messages(raw))


def test_an_entry_decodes_to_its_flow() -> None:
    assert ct.decode(entry()) == Flow(17, "172.18.0.100", 40000, "172.18.0.10", 53, "10.0.1.11", 5353, 123456, 0)
    assert ct.decode(entry(zone=7)).zone == 7


def test_an_entry_without_ports_is_not_a_flow() -> None:
    payload = nl.attr_nested(ct.CTA_TUPLE_ORIG, [nl.attr_nested(ct.CTA_TUPLE_IP, [
        nl.attr_bytes(ct.CTA_IP_V4_SRC, socket.inet_aton("1.1.1.1")),
        nl.attr_bytes(ct.CTA_IP_V4_DST, socket.inet_aton("2.2.2.2"))])])
    raw = nl.build_message(nl.NFNL_SUBSYS_CTNETLINK << 8, 0, 1, 2, payload)
    assert ct.decode(next(nl.split_messages(raw))) is None
    truncated = entry()
    assert ct.decode(truncated._replace(end=truncated.end - 3)) is None  # malformed: skipped, never raised


def test_a_delete_names_the_tuple_the_zone_and_the_kernels_id() -> None:
    flow = Flow(17, "172.18.0.100", 40000, "172.18.0.10", 53, "10.0.1.11", 5353, 123456, 7)
    got = nl.attrs(ct.delete_attrs(flow))
    assert set(got) == {ct.CTA_TUPLE_ORIG, ct.CTA_ZONE, ct.CTA_ID}
    assert nl.get_be32(got[ct.CTA_ID]) == 123456 and nl.get_be16(got[ct.CTA_ZONE]) == 7
    orig = ct._decode_tuple(got[ct.CTA_TUPLE_ORIG], 0, len(got[ct.CTA_TUPLE_ORIG]))
    assert orig == ("172.18.0.100", "172.18.0.10", 17, 40000, 53)
    assert ct.CTA_ZONE not in nl.attrs(ct.delete_attrs(flow._replace(zone=0, id=None)))


def test_a_dump_asks_the_kernel_to_filter_by_destination_protocol_and_port() -> None:
    got = nl.attrs(b"".join(ct.filter_attrs(Query("172.18.0.10", 17, 53))))
    flags = struct.unpack("=I", nl.attrs(got[ct.CTA_FILTER])[ct.CTA_FILTER_ORIG_FLAGS])[0]
    assert flags == ct.FILTER_IP_DST | ct.FILTER_PROTO_NUM | ct.FILTER_PROTO_DST_PORT
    tup = ct._decode_tuple(got[ct.CTA_TUPLE_ORIG], 0, len(got[ct.CTA_TUPLE_ORIG]))
    assert tup == (None, "172.18.0.10", 17, None, 53)
    flags = struct.unpack("=I", nl.attrs(nl.attrs(b"".join(ct.filter_attrs(Query("172.18.0.10", 6))))[ct.CTA_FILTER])
                          [ct.CTA_FILTER_ORIG_FLAGS])[0]
    assert flags == ct.FILTER_IP_DST | ct.FILTER_PROTO_NUM  # no port: every port of the address
