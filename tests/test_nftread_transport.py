"""The netlink transport and attribute codec under the read-back (agent/kernel/nfnetlink.py):
scripted kernel answers, no root."""
from __future__ import annotations

import errno
import struct
from pathlib import Path
from typing import Any

import pytest

from agent.kernel import nfnetlink as nl
from agent.kernel import nftuapi as uapi
from tests.netlinkfx import IP
from tests.nlmsg import attr_be64, nft_type


def test_attributes_round_trip_with_nesting_masked() -> None:
    payload = nl.attr_str(1, "natgw") + nl.attr_be32(3, 0x30) + \
        nl.attr_nested(9, [nl.attr_be32(1, 262144)]) + attr_be64(16, 5)
    a = nl.attrs(payload)
    assert nl.get_str(a[1]) == "natgw" and nl.get_be32(a[3]) == 0x30 and nl.get_be64(a[16]) == 5
    assert nl.get_be32(nl.attrs(a[9])[1]) == 262144  # type 9 | NLA_F_NESTED read back as 9
    assert [t for t, _ in nl.attr_list(payload)] == [1, 3, 9, 16]
    with pytest.raises(nl.MalformedError):
        nl.attrs(payload[:-2])


class _ScriptedSocket(nl.NfSocket):
    """An NfSocket whose kernel side is a list of datagrams built per request."""

    def __init__(self, script: Any) -> None:
        super().__init__(timeout=0.2)
        self.script = script
        self.queue: list[bytes] = []

    def send(self, msg: int, family: int, payload: bytes, flags: int) -> int:
        seq = self._next_seq()
        self.queue += self.script(seq)
        return seq

    def _recv(self, what: str, timeout: float) -> bytes:
        if not self.queue:
            raise nl.NetlinkTimeout(what, timeout)
        return self.queue.pop(0)


def _dgram(seq: int, msg_type: int, flags: int = 0, payload: bytes = b"", family: int = IP) -> bytes:
    return nl.build_message(msg_type, flags, seq, family, payload)


def _done(seq: int, flags: int = 0) -> bytes:
    return struct.pack("=IHHII", 20, nl.NLMSG_DONE, flags | nl.NLM_F_MULTI, seq, 0) + b"\0\0\0\0"


def _error(seq: int, code: int) -> bytes:
    return struct.pack("=IHHIIi", 36, nl.NLMSG_ERROR, 0, seq, 0, -code) + b"\0" * 16


def test_a_dump_records_an_interruption_instead_of_failing() -> None:
    def script(seq: int) -> list[bytes]:
        m = nft_type(uapi.NFT_MSG_NEWSET)
        return [_dgram(seq, m, nl.NLM_F_MULTI) + _dgram(seq, m, nl.NLM_F_MULTI | nl.NLM_F_DUMP_INTR), _done(seq)]

    with _ScriptedSocket(script) as sock:
        dump = sock.dump(uapi.NFT_MSG_GETSET, IP)
        assert len(list(dump)) == 2 and dump.interrupted  # list() returning: the dump ended at NLMSG_DONE


def test_errors_carry_the_kernels_errno_and_stale_answers_are_dropped() -> None:
    def script(seq: int) -> list[bytes]:
        return [_dgram(seq - 1, nft_type(uapi.NFT_MSG_NEWSET), nl.NLM_F_MULTI), _error(seq, errno.ENOENT)]

    with _ScriptedSocket(script) as sock:
        got: list[nl.Message] = []
        with pytest.raises(nl.NetlinkError) as err:
            got.extend(sock.dump(uapi.NFT_MSG_GETSET, IP))  # extend() keeps what came before the error
        assert err.value.errno == errno.ENOENT and got == []  # the earlier request's answer: dropped
        with pytest.raises(nl.NetlinkError):
            sock.request(uapi.NFT_MSG_GETTABLE, IP)


def test_every_wait_has_a_timeout() -> None:
    with _ScriptedSocket(lambda seq: []) as sock:
        with pytest.raises(nl.NetlinkTimeout):
            sock.request(uapi.NFT_MSG_GETGEN, 0)
        with pytest.raises(TimeoutError):
            list(sock.dump(uapi.NFT_MSG_GETSET, IP))


def test_own_portids_reads_this_process(tmp_path: Path) -> None:
    with nl.NfSocket() as sock:
        assert sock.portid in nl.own_portids()
    assert nl.own_portids(pid="nonexistent") == set()
