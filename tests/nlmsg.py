"""Netlink pieces only tests build (the agent never sends a 64-bit attribute, and builds
its message types inside NfSocket)."""
from __future__ import annotations

import struct

from agent.kernel.nfnetlink import NFNL_SUBSYS_NFTABLES, attr_bytes


def nft_type(msg: int) -> int:
    """An nf_tables message type as the kernel sends it (subsystem in the high byte)."""
    return NFNL_SUBSYS_NFTABLES << 8 | msg


def attr_be64(typ: int, value: int) -> bytes:
    return attr_bytes(typ, struct.pack("!Q", value))
