"""nfnetlink transport (nf_tables, and conntrack's ctnetlink): raw AF_NETLINK sockets
and the attribute codec.

No nftables or conntrack semantics here (agent/kernel/nftread.py with its decoders and
agent/kernel/ctnetlink.py decode objects). Three pieces:

- `NfSocket`: requests, batches of acked requests and multipart dumps over one
  NETLINK_NETFILTER socket, for one nfnetlink subsystem. A netlink
  socket belongs to the network namespace it was created in, whatever the process does
  later. Sequence numbers are checked (a reply to an earlier, abandoned request is
  dropped), every receive has a timeout, and a dump records whether any of its messages
  carried NLM_F_DUMP_INTR (the ruleset generation moved while the kernel was filling it)
  instead of failing: the caller decides whether that matters.
- the attribute codec: `iter_attrs`/`attrs` over (type, value) TLVs with NLA_F_NESTED
  masked, and builders (`attr_str`, `attr_be32`, `attr_nested`, ...) for requests.
  Offsets into one bytes object and struct.unpack_from, no object per attribute.
- `Subscriber`: a non-blocking socket in group NFNLGRP_NFTABLES (what `nft monitor` reads):
  `fileno()` for select/poll, `drain()` for what arrived so far, an overrun (ENOBUFS: the
  kernel dropped notifications) reported as `Drained.overrun`, after which only a full
  read-back tells the state.

Every notification's nlmsg_pid is the netlink port id of the socket that sent the
committing batch (and NFT_MSG_NEWGEN, sent last for each commit, also names the
committing process: NFTA_GEN_PROC_PID, NFTA_GEN_PROC_NAME). `own_portids()` lists the
port ids of this process's own NETLINK_NETFILTER sockets (libnftables' among them), so a
caller can tell its own commits from others'.

Constants are from the kernel's uapi (linux/netlink.h, linux/netfilter/nfnetlink.h,
linux/netfilter/nf_tables.h)."""
from __future__ import annotations

import errno as errnos
import os
import select
import socket
import struct
import time
from typing import Collection, Iterable, Iterator, NamedTuple

# linux/netlink.h
NETLINK_NETFILTER = 12
NLMSG_NOOP, NLMSG_ERROR, NLMSG_DONE, NLMSG_OVERRUN = 1, 2, 3, 4
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK = 0x1, 0x2, 0x4
NLM_F_DUMP_INTR, NLM_F_DUMP_FILTERED = 0x10, 0x20
NLM_F_ROOT, NLM_F_MATCH = 0x100, 0x200
NLM_F_DUMP = NLM_F_ROOT | NLM_F_MATCH
NLM_F_CAPPED, NLM_F_ACK_TLVS = 0x100, 0x200  # in an NLMSG_ERROR: request not echoed; ack attributes
NLMSGERR_ATTR_MSG = 1
NLA_F_NESTED, NLA_F_NET_BYTEORDER = 0x8000, 0x4000
NLA_TYPE_MASK = ~(NLA_F_NESTED | NLA_F_NET_BYTEORDER) & 0xFFFF
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP, NETLINK_DROP_MEMBERSHIP, NETLINK_CAP_ACK, NETLINK_EXT_ACK = 1, 2, 10, 11
SO_RCVBUFFORCE = 33

# linux/netfilter/nfnetlink.h
NFNL_SUBSYS_CTNETLINK = 1
NFNL_SUBSYS_NFTABLES = 10
NFNLGRP_NFTABLES = 7
NFNETLINK_V0 = 0

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (big endian: read apart)
NLA = struct.Struct("=HH")  # an attribute's header: length, type
BE16 = struct.Struct("!H")
BE32 = struct.Struct("!I")
BE64 = struct.Struct("!Q")
_ERR = struct.Struct("=i")
HDR_LEN = _NLMSGHDR.size + _NFGENMSG.size  # 20: where a nf_tables message's attributes start

DEFAULT_TIMEOUT = 5.0
_RECV_BUF = 1 << 20  # one datagram: the kernel fills at most 32 KiB per dump skb
_SOCK_RCVBUF = 8 << 20  # socket buffer for bursts of notifications


class NetlinkError(OSError):
    """The kernel answered NLMSG_ERROR (errno, e.g. ENOENT for a missing table), or the
    exchange broke (EBADMSG for a malformed message, ETIMEDOUT, EPROTO)."""

    def __init__(self, code: int, what: str, detail: str = "") -> None:
        text = f"{what}: {os.strerror(code)}" + (f" ({detail})" if detail else "")
        super().__init__(code, text)
        self.what = what
        self.detail = detail


class NetlinkTimeout(NetlinkError, TimeoutError):
    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(errnos.ETIMEDOUT, what, f"no answer within {seconds:g} s")


class Message(NamedTuple):
    """One nf_tables netlink message: its header fields and its attributes as
    buf[start:end] (buf is the whole datagram, shared by the messages in it; the
    message's header is at buf[head])."""

    type: int  # nlmsg_type: subsystem << 8 | message
    flags: int
    seq: int
    portid: int  # nlmsg_pid: for a notification, the committing socket's port id
    family: int  # nfgen_family
    res_id: int  # nfgen res_id: the kernel's generation, low 16 bits
    buf: bytes
    start: int
    end: int
    head: int

    @property
    def msg(self) -> int:
        return self.type & 0xFF

    @property
    def subsys(self) -> int:
        return self.type >> 8

    def attrs(self) -> dict[int, bytes]:
        return attrs(self.buf, self.start, self.end)


# --- attribute codec --------------------------------------------------------------------

class MalformedError(ValueError):
    """An attribute or message whose length does not fit its container."""


def iter_attrs(buf: bytes, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int]]:
    """(type, value start, value end) of each attribute in buf[start:end], NLA_F_NESTED
    and NLA_F_NET_BYTEORDER masked off. Raises MalformedError on a length that does not fit."""
    if end is None:
        end = len(buf)
    off = start
    unpack = NLA.unpack_from
    while off + 4 <= end:
        length, typ = unpack(buf, off)
        if length < 4 or off + length > end:
            raise MalformedError(f"attribute length {length} at {off} exceeds {end}")
        yield typ & NLA_TYPE_MASK, off + 4, off + length
        off += (length + 3) & ~3


def attrs(buf: bytes, start: int = 0, end: int | None = None) -> dict[int, bytes]:
    """The attributes in buf[start:end] by type (the last one wins), values as bytes."""
    return {t: buf[a:b] for t, a, b in iter_attrs(buf, start, end)}


def attr_list(buf: bytes, start: int = 0, end: int | None = None) -> list[tuple[int, bytes]]:
    """The attributes in order, repeated types kept (NFTA_LIST_ELEM lists)."""
    return [(t, buf[a:b]) for t, a, b in iter_attrs(buf, start, end)]


def get_str(value: bytes) -> str:
    """A NUL-terminated netlink string."""
    cut = value.find(b"\0")
    return (value if cut < 0 else value[:cut]).decode("utf-8", "replace")


def get_be16(value: bytes) -> int:
    return int(BE16.unpack_from(value)[0])


def get_be32(value: bytes) -> int:
    return int(BE32.unpack_from(value)[0])


def get_be64(value: bytes) -> int:
    return int(BE64.unpack_from(value)[0])


def get_sbe32(value: bytes) -> int:
    v = get_be32(value)
    return v - (1 << 32) if v & 0x80000000 else v


def attr_bytes(typ: int, value: bytes) -> bytes:
    length = 4 + len(value)
    return NLA.pack(length, typ) + value + b"\0" * (-length & 3)


def attr_str(typ: int, value: str) -> bytes:
    return attr_bytes(typ, value.encode() + b"\0")


def attr_be32(typ: int, value: int) -> bytes:
    return attr_bytes(typ, BE32.pack(value & 0xFFFFFFFF))


def attr_nested(typ: int, children: Iterable[bytes]) -> bytes:
    return attr_bytes(typ | NLA_F_NESTED, b"".join(children))


def build_message(msg_type: int, flags: int, seq: int, family: int, payload: bytes, res_id: int = 0) -> bytes:
    return (_NLMSGHDR.pack(HDR_LEN + len(payload), msg_type, flags, seq, 0)
            + _NFGENMSG.pack(family, NFNETLINK_V0, socket.htons(res_id)) + payload)


def split_messages(buf: bytes) -> Iterator[Message]:
    """The netlink messages in one datagram (or in concatenated recorded messages).
    Raises MalformedError when a header's length does not fit."""
    off, n = 0, len(buf)
    unpack = _NLMSGHDR.unpack_from
    while off + 16 <= n:
        length, typ, flags, seq, pid = unpack(buf, off)
        if length < 16 or off + length > n:
            raise MalformedError(f"message length {length} at {off} exceeds {n}")
        if length >= HDR_LEN:
            family, _version, res = _NFGENMSG.unpack_from(buf, off + 16)
            yield Message(typ, flags, seq, pid, family, socket.ntohs(res), buf, off + HDR_LEN, off + length, off)
        else:  # NLMSG_DONE of 16 bytes and the like: no nfgenmsg
            yield Message(typ, flags, seq, pid, 0, 0, buf, off + length, off + length, off)
        off += (length + 3) & ~3


def error_code(message: Message) -> tuple[int, str]:
    """(errno, extended-ack text) of an NLMSG_ERROR (0: an ack)."""
    base = message.head + 16  # struct nlmsgerr: error, then the request's header (and more)
    if base + 4 > message.end:
        return errnos.EBADMSG, "short NLMSG_ERROR"
    (code,) = _ERR.unpack_from(message.buf, base)
    text = ""
    if message.flags & NLM_F_ACK_TLVS and base + 20 <= message.end:
        inner_len = _NLMSGHDR.unpack_from(message.buf, base + 4)[0]
        # with NETLINK_CAP_ACK set the kernel echoes only the request's header
        tlv = base + 4 + (16 if message.flags & NLM_F_CAPPED else max(16, (inner_len + 3) & ~3))
        try:
            for t, a, b in iter_attrs(message.buf, tlv, message.end):
                if t == NLMSGERR_ATTR_MSG:
                    text = get_str(message.buf[a:b])
        except MalformedError:
            pass
    return -code, text


# --- requests and dumps -----------------------------------------------------------------

class Dump:
    """The messages of one multipart dump, in order, as they arrive; `interrupted` is
    True once any of them carried NLM_F_DUMP_INTR. Iterate it once."""

    def __init__(self, sock: NfSocket, seq: int, what: str, timeout: float) -> None:
        self._sock = sock
        self._seq = seq
        self._what = what
        self._timeout = timeout
        self.interrupted = False

    def __iter__(self) -> Iterator[Message]:
        # Abandoned midway, the rest of the dump is dropped by its seq on the next exchange.
        sock = self._sock
        while True:
            for m in sock._receive(self._seq, self._what, self._timeout):
                if m.flags & NLM_F_DUMP_INTR:
                    self.interrupted = True
                if m.type == NLMSG_DONE:
                    return
                if m.type == NLMSG_ERROR:
                    code, text = error_code(m)
                    if code == 0:
                        continue
                    raise NetlinkError(code, self._what, text)
                if m.type in (NLMSG_NOOP, NLMSG_OVERRUN):
                    continue
                yield m


class NfSocket:
    """One NETLINK_NETFILTER socket for requests and dumps of one subsystem (nf_tables
    unless told), in the network namespace of the thread that creates it."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, rcvbuf: int = _SOCK_RCVBUF,
                 subsys: int = NFNL_SUBSYS_NFTABLES) -> None:
        self.timeout = timeout
        self.subsys = subsys
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            _grow_rcvbuf(self._sock, rcvbuf)
            for opt in (NETLINK_EXT_ACK, NETLINK_CAP_ACK):
                try:
                    self._sock.setsockopt(SOL_NETLINK, opt, 1)
                except OSError:
                    pass
            self._sock.bind((0, 0))
            self.portid: int = self._sock.getsockname()[0]
        except BaseException:
            self._sock.close()
            raise
        self._seq = int(time.time()) & 0x7FFFFFFF
        self._buf = bytearray(_RECV_BUF)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> NfSocket:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def fileno(self) -> int:
        return self._sock.fileno()

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
        return self._seq

    def send(self, msg: int, family: int, payload: bytes, flags: int) -> int:
        seq = self._next_seq()
        self._sock.send(build_message(self.subsys << 8 | msg, NLM_F_REQUEST | flags, seq, family, payload))
        return seq

    def batch(self, msg: int, family: int, payloads: list[bytes], timeout: float | None = None) -> list[int]:
        """Many requests of one kind in one datagram (the kernel takes them in order), each
        acked: their errnos, in order (0: done). A few hundred at a time: the datagram
        must fit the socket's send buffer (~200 KB by default)."""
        seqs = [self._next_seq() for _ in payloads]
        kind = self.subsys << 8 | msg
        self._sock.send(b"".join(build_message(kind, NLM_F_REQUEST | NLM_F_ACK, seq, family, p)
                                 for seq, p in zip(seqs, payloads)))
        index = {seq: i for i, seq in enumerate(seqs)}
        codes: list[int | None] = [None] * len(seqs)
        left, what = len(seqs), f"batch of {len(seqs)} msg {msg}"
        limit = self.timeout if timeout is None else timeout
        while left:
            for m in self._datagram(what, limit):
                i = index.get(m.seq)
                if i is None or m.type != NLMSG_ERROR or codes[i] is not None:
                    continue  # a stale answer (to an earlier request)
                codes[i] = error_code(m)[0]
                left -= 1
        return [c or 0 for c in codes]

    def request(self, msg: int, family: int, attrs: Iterable[bytes] = (), flags: int = 0,
                timeout: float | None = None) -> Message | None:
        """One request, one answer: the kernel's message (None when it answered only an
        ack, with NLM_F_ACK in flags). Raises NetlinkError with the kernel's errno."""
        what = f"request {self.subsys}/{msg}"
        seq = self.send(msg, family, b"".join(attrs), flags)
        answer: Message | None = None
        limit = self.timeout if timeout is None else timeout
        while True:
            for m in self._receive(seq, what, limit):
                if m.type == NLMSG_ERROR:
                    code, text = error_code(m)
                    if code:
                        raise NetlinkError(code, what, text)
                    return answer  # the ack ends the exchange
                if m.type in (NLMSG_NOOP, NLMSG_DONE):
                    continue
                answer = m
                if not flags & NLM_F_ACK:
                    return answer

    def dump(self, msg: int, family: int, attrs: Iterable[bytes] = (), flags: int = 0,
             timeout: float | None = None) -> Dump:
        """Start a multipart dump (NLM_F_DUMP); iterate the returned Dump for its messages."""
        seq = self.send(msg, family, b"".join(attrs), NLM_F_DUMP | flags)
        return Dump(self, seq, f"dump {self.subsys}/{msg}", self.timeout if timeout is None else timeout)

    def _receive(self, seq: int, what: str, timeout: float) -> Iterator[Message]:
        """The messages of the next datagram answering `seq` (older answers dropped)."""
        while True:
            messages = self._datagram(what, timeout)
            mine = [m for m in messages if m.seq == seq]
            # Anything else answers an earlier request of this socket (an abandoned dump's
            # tail): the kernel sends nothing unasked on a socket outside any group.
            if mine:
                return iter(mine)

    def _datagram(self, what: str, timeout: float) -> list[Message]:
        """The messages of the next datagram."""
        data = self._recv(what, timeout)
        try:
            return list(split_messages(data))
        except MalformedError as err:
            raise NetlinkError(errnos.EBADMSG, what, str(err)) from None

    def _recv(self, what: str, timeout: float) -> bytes:
        sock = self._sock
        ready, _, _ = select.select([sock], [], [], timeout)
        if not ready:
            raise NetlinkTimeout(what, timeout)
        try:
            n = sock.recv_into(self._buf, len(self._buf), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return b""
        except OSError as err:  # ENOBUFS on a request socket: an answer was lost
            raise NetlinkError(err.errno or errnos.EIO, what, "receive failed") from None
        return bytes(memoryview(self._buf)[:n])


def _grow_rcvbuf(sock: socket.socket, size: int) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, size)  # root: past rmem_max
    except OSError:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
        except OSError:
            pass


# --- notifications ----------------------------------------------------------------------

class Drained(NamedTuple):
    """What drain() found: the messages received so far, and whether the kernel dropped
    some (ENOBUFS) since the last drain: then the caller must read everything back."""

    messages: list[Message]
    overrun: bool


class Subscriber:
    """A non-blocking socket joined to NFNLGRP_NFTABLES (every committed nf_tables change
    of this network namespace, what `nft monitor` reads)."""

    def __init__(self, group: int = NFNLGRP_NFTABLES, rcvbuf: int = _SOCK_RCVBUF) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            _grow_rcvbuf(self._sock, rcvbuf)
            self._sock.bind((0, 0))
            self._sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, group)
            self._sock.setblocking(False)
            self.portid: int = self._sock.getsockname()[0]
        except BaseException:
            self._sock.close()
            raise
        self.group = group
        self._buf = bytearray(_RECV_BUF)

    def listen(self, on: bool) -> None:
        """Join or leave the group (what is queued already stays to be drained)."""
        self._sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP if on else NETLINK_DROP_MEMBERSHIP, self.group)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def wait(self, timeout: float) -> bool:
        """Block at most `timeout` seconds until something can be drained."""
        ready, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        return bool(ready)

    def drain(self, limit: int = 1 << 30, skip: Collection[int] = ()) -> Drained:
        """Every message queued now (at most about `limit`), without blocking, but those
        sent by the port ids in `skip`: a datagram holding only theirs is dropped unread
        (the agent's own transaction of 50,000 elements comes back as 50,000 messages;
        kept, they took 16 MB, and longer to drain than the transaction itself)."""
        out: list[Message] = []
        overrun = False
        view = memoryview(self._buf)
        while len(out) < limit:
            try:
                n = self._sock.recv_into(self._buf)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno == errnos.ENOBUFS:
                    overrun = True
                    continue
                raise
            try:
                if not skip or not _only_from(self._buf, n, skip):
                    out.extend(m for m in split_messages(bytes(view[:n])) if m.portid not in skip)
            except MalformedError:
                overrun = True  # a datagram we cannot split: as good as lost
        return Drained(out, overrun)


def _only_from(buf: bytearray, n: int, portids: Collection[int]) -> bool:
    """Whether every message of the datagram buf[:n] was sent by one of `portids` (read
    from the headers in place: nothing is copied or decoded)."""
    off = 0
    unpack = _NLMSGHDR.unpack_from
    while off + 16 <= n:
        length, _typ, _flags, _seq, pid = unpack(buf, off)
        if length < 16 or off + length > n:
            raise MalformedError(f"message length {length} at {off} exceeds {n}")
        if pid not in portids:
            return False
        off += (length + 3) & ~3
    return True


# --- this process's own port ids ----------------------------------------------------------

def own_portids(protocol: int = NETLINK_NETFILTER, pid: int | str = "self") -> set[int]:
    """Netlink port ids of the process's open sockets of this protocol (libnftables'
    included), from /proc/<pid>/fd socket inodes joined with /proc/<pid>/net/netlink.
    Read it after the sockets exist: libnftables opens its socket with the context, and
    may reopen it."""
    inodes: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return set()
    for name in names:
        try:
            link = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    ports: set[int] = set()
    try:
        with open(f"/proc/{pid}/net/netlink") as f:
            next(f, None)  # header: sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode
            for line in f:
                fields = line.split()
                if len(fields) >= 10 and int(fields[1]) == protocol and int(fields[9]) in inodes:
                    ports.add(int(fields[2]))
    except (OSError, ValueError):
        return ports
    return ports
