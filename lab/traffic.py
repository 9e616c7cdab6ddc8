"""Traffic helpers that run *inside* a lab network namespace.

The parent (lab.topology) starts this module with
``ip netns exec NS python -m lab.traffic SUBCOMMAND ...``.  Every
subcommand prints its result as one JSON line on stdout; long-running ones
(``serve``, ``sniff``) first print ``ready`` and then run until stdin is
closed (so they also die when the parent dies) or they are signalled.

scapy reads interfaces and routes at import time, so it is imported lazily,
only by the subcommands that need it (``sniff``, ``syn``) and therefore only
inside the namespace.  ``serve``, ``connect`` and ``udp`` use plain sockets, as do
the benchmarks' (bench/) ``serve-addr``, ``timed``, ``reach`` and ``udp-ports``.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import random
import socket
import socketserver
import struct
import sys
import threading
import time
from collections import Counter, defaultdict
from typing import Any

# Sequence number marking the sniffer's self-test ("canary") SYN.
CANARY_SEQ = 0x6C616221  # "lab!"

# Linux constants not always exported by the socket module.
SO_ATTACH_FILTER = 26
SO_RCVBUFFORCE = 33
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, sort_keys=True), flush=True)


def _wait_for_stdin_eof(duration: float | None) -> None:
    """Block until the parent closes our stdin (or `duration` elapses)."""
    reader = threading.Thread(target=sys.stdin.buffer.read, daemon=True)
    reader.start()
    reader.join(duration)


class EmptyAnswer(OSError):
    """The peer closed / answered without sending a name."""


def _error_kind(exc: OSError) -> str:
    if isinstance(exc, EmptyAnswer):
        return "empty"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


class _Results:
    """Accumulates per-backend / per-source answers and failure kinds."""

    def __init__(self) -> None:
        self.by_backend: Counter[str] = Counter()
        self.by_source: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.errors: Counter[str] = Counter()

    def ok(self, source: str, name: str) -> None:
        self.by_backend[name] += 1
        self.by_source[source][name] += 1

    def fail(self, kind: str) -> None:
        self.errors[kind] += 1

    def as_dict(self, count: int) -> dict[str, Any]:
        return {
            "count": count,
            "by_backend": dict(self.by_backend),
            "by_source": {src: dict(c) for src, c in self.by_source.items()},
            "failed": sum(self.errors.values()),
            "errors": dict(self.errors),
        }


# --------------------------------------------------------------------- serve


class _NameHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        # Send the name and return: socketserver then closes the connection.
        self.request.sendall(self.server.reply)  # type: ignore[attr-defined]


class _NameTCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 1024  # hundreds of quick connections must not be dropped

    def __init__(self, port: int, reply: bytes) -> None:
        self.reply = reply
        super().__init__(("0.0.0.0", port), _NameHandler)

    def handle_error(self, request: object, client_address: object) -> None:
        # The agent's health checks connect and reset before the name is sent: no
        # traceback for those (one per check, a page a second in the tests' output).
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


def _udp_echo_name(sock: socket.socket, reply: bytes) -> None:
    while True:
        _, peer = sock.recvfrom(2048)
        sock.sendto(reply, peer)


def cmd_serve(args: argparse.Namespace) -> int:
    reply = f"{args.name}\n".encode()
    for port in args.tcp_port:
        server = _NameTCPServer(port, reply)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    for port in args.udp_port:
        usock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        usock.bind(("0.0.0.0", port))
        threading.Thread(target=_udp_echo_name, args=(usock, reply), daemon=True).start()
    # Sockets are bound and listening before we say so.
    print("ready", flush=True)
    _wait_for_stdin_eof(None)
    return 0


# ------------------------------------------------------------- connect / udp


def _tcp_once(dst: str, port: int, source: str | None, timeout: float) -> tuple[str, str]:
    """One fresh TCP connection; returns (local_ip, name). Raises OSError."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        if source:
            # Let connect() pick the port, so sources share the full port range.
            s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.bind((source, 0))
        s.connect((dst, port))
        local_ip = s.getsockname()[0]
        # Read to EOF: the server closes first, so the client never holds
        # TIME_WAIT sockets that would slow down long runs.
        data = b""
        while chunk := s.recv(256):
            data += chunk
    name = data.decode(errors="replace").strip()
    if not name:
        raise EmptyAnswer("empty answer")
    return local_ip, name


def cmd_connect(args: argparse.Namespace) -> int:
    res = _Results()
    sources: list[str] = args.source or []
    for i in range(args.count):
        src = sources[i % len(sources)] if sources else None
        try:
            local_ip, name = _tcp_once(args.dst, args.port, src, args.timeout)
        except OSError as exc:
            res.fail(_error_kind(exc))
            continue
        res.ok(local_ip, name)
    _emit(res.as_dict(args.count))
    return 0


def _udp_socket(source: str | None, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind((source or "0.0.0.0", port))
    except OSError:
        s.close()
        raise
    return s


class _PortWalker:
    """Hands out distinct local UDP ports, so every query is a new conntrack
    flow (the kernel's random choice repeats ports within a few hundred)."""

    def __init__(self) -> None:
        self.next = random.randrange(20000, 40000)

    def open(self, source: str | None) -> socket.socket:
        while self.next < 65536:
            port, self.next = self.next, self.next + 1
            try:
                return _udp_socket(source, port)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        raise OSError(errno.EADDRNOTAVAIL, "out of local UDP ports")


def _udp_ask(s: socket.socket, timeout: float) -> str:
    s.settimeout(timeout)
    s.send(b"?\n")
    data = s.recv(2048)
    name = data.decode(errors="replace").strip()
    if not name:
        raise EmptyAnswer("empty answer")
    return name


def cmd_udp(args: argparse.Namespace) -> int:
    res = _Results()
    sources: list[str] = args.source or []
    walker = _PortWalker()
    shared: socket.socket | None = None
    try:
        if args.same_flow:
            # One socket, one source port: every query is the same flow.
            shared = _udp_socket(sources[0] if sources else None, 0)
            shared.connect((args.dst, args.port))
        for i in range(args.count):
            src = sources[i % len(sources)] if sources else None
            s = shared
            try:
                if s is None:
                    s = walker.open(src)
                    s.connect((args.dst, args.port))
                name = _udp_ask(s, args.timeout)
                res.ok(s.getsockname()[0], name)
            except OSError as exc:
                res.fail(_error_kind(exc))
            finally:
                if s is not None and s is not shared:
                    s.close()
    finally:
        if shared is not None:
            shared.close()
    _emit(res.as_dict(args.count))
    return 0


def cmd_stream(args: argparse.Namespace) -> int:
    """One flow (one socket, one source port) sending every --interval seconds, one way
    until something answers: prints "ready", then a JSON line per answer with its wall
    time, and stops on stdin EOF (or --duration)."""
    s = _udp_socket(args.source, args.sport)
    s.settimeout(args.interval)
    stop = threading.Event()

    def until_eof() -> None:
        sys.stdin.buffer.read()
        stop.set()

    threading.Thread(target=until_eof, daemon=True).start()
    print("ready", flush=True)
    started, sent = time.monotonic(), 0
    while not stop.is_set() and time.monotonic() - started < args.duration:
        s.sendto(b"?\n", (args.dst, args.port))
        sent += 1
        deadline = time.monotonic() + args.interval
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                data, _ = s.recvfrom(2048)
            except (TimeoutError, OSError):
                break
            _emit({"t": time.time(), "name": data.decode(errors="replace").strip()})
    s.close()
    _emit({"sent": sent})
    return 0


# --------------------------------------------------------------------- sniff


def _syn_bpf(dport: int) -> list[tuple[int, int, int, int]]:
    """Classic BPF: IPv4, unfragmented TCP, dst port `dport`, SYN without ACK.

    Hand-assembled because scapy compiles filter strings with libpcap or
    tcpdump, neither of which is guaranteed to be installed.
    """
    return [
        (0x28, 0, 0, 12),          # 0: ldh [12]            ethertype
        (0x15, 0, 10, 0x0800),     # 1: jeq IPv4 ? 2 : 12
        (0x30, 0, 0, 23),          # 2: ldb [23]            ip proto
        (0x15, 0, 8, 6),           # 3: jeq TCP ? 4 : 12
        (0x28, 0, 0, 20),          # 4: ldh [20]            frag offset
        (0x45, 6, 0, 0x1FFF),      # 5: jset frag ? 12 : 6
        (0xB1, 0, 0, 14),          # 6: ldxb 4*([14]&0xf)  ip header len
        (0x48, 0, 0, 16),          # 7: ldh [x+16]          tcp dport
        (0x15, 0, 3, dport),       # 8: jeq dport ? 9 : 12
        (0x50, 0, 0, 27),          # 9: ldb [x+27]          tcp flags
        (0x54, 0, 0, 0x12),        # 10: and SYN|ACK
        (0x15, 1, 0, 0x02),        # 11: jeq SYN ? 13 : 12
        (0x06, 0, 0, 0),           # 12: ret 0 (drop)
        (0x06, 0, 0, 0x40000),     # 13: ret 256k (accept)
    ]


def _attach_bpf(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> None:
    insns = b"".join(struct.pack("HBBI", *ins) for ins in program)
    buf = ctypes.create_string_buffer(insns)
    fprog = struct.pack("HL", len(program), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def cmd_sniff(args: argparse.Namespace) -> int:
    from scapy.all import IP, TCP, AsyncSniffer, Ether, conf, get_if_addr, get_if_hwaddr, sendp

    my_ip = get_if_addr(args.iface)
    my_mac = get_if_hwaddr(args.iface)
    # Open the capture socket ourselves: it queues packets from this moment
    # on, independent of when the sniffer thread gets scheduled.
    lsock = conf.L2listen(iface=args.iface, promisc=False)
    _attach_bpf(lsock.ins, _syn_bpf(args.dport))
    lsock.ins.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)

    seen: set[tuple[str, int]] = set()
    state = {"syns": 0, "canary": False, "last": time.monotonic()}

    def on_packet(pkt: Any) -> None:
        if IP not in pkt or TCP not in pkt:
            return
        ip, tcp = pkt[IP], pkt[TCP]
        if tcp.seq == CANARY_SEQ:
            state["canary"] = state["canary"] or ip.dst == my_ip
            return
        # veth frames of other hosts may be flooded to us by the bridge; and the
        # gateway's own connections (the agent's health checks) are not the traffic counted.
        if ip.dst != my_ip or ip.src in args.ignore_source:
            return
        state["syns"] += 1
        state["last"] = time.monotonic()
        seen.add((ip.src, tcp.sport))

    sniffer = AsyncSniffer(opened_socket=lsock, prn=on_packet, store=False)
    sniffer.start()

    # Prove end to end (socket, BPF, sniffer thread) that a matching SYN is
    # counted: send one to ourselves.  dst MAC is our own, so the bridge
    # drops it and nobody else sees it.
    canary = (
        Ether(src=my_mac, dst=my_mac)
        / IP(src=my_ip, dst=my_ip)
        / TCP(sport=9, dport=args.dport, flags="S", seq=CANARY_SEQ)
    )
    deadline = time.monotonic() + args.ready_timeout
    while not state["canary"]:
        if time.monotonic() > deadline:
            print("sniffer did not see its canary packet", file=sys.stderr, flush=True)
            sniffer.stop()
            return 1
        sendp(canary, iface=args.iface, verbose=0)
        time.sleep(0.05)
    print("ready", flush=True)

    _wait_for_stdin_eof(args.duration)
    # Drain: keep capturing until no SYN arrived for a short quiet period.
    drain_deadline = time.monotonic() + 3.0
    while time.monotonic() - state["last"] < 0.3 and time.monotonic() < drain_deadline:
        time.sleep(0.05)
    sniffer.stop()
    _emit({"syns": len(seen), "packets": state["syns"], "ip": my_ip})
    return 0


# ----------------------------------------------------------------------- syn


def cmd_syn(args: argparse.Namespace) -> int:
    from scapy.all import IP, TCP, send

    sports = random.sample(range(1024, 65536), args.count)
    pkts = []
    for sport in sports:
        seq = random.getrandbits(32)
        if seq == CANARY_SEQ:
            seq += 1
        pkts.append(IP(src=args.src, dst=args.dst) / TCP(sport=sport, dport=args.dport, flags="S", seq=seq))
    send(pkts, inter=args.inter, verbose=0)
    _emit({"sent": len(pkts)})
    return 0


# ------------------------------------------------- for the benchmarks (bench/)


_IP_PKTINFO = 8  # linux/in.h; Python's socket module does not name it on every build
_PKTINFO = struct.Struct("=I4s4s")  # struct in_pktinfo: ifindex, spec_dst, addr


def _udp_echo_addr(port: int) -> None:
    """Answer every datagram with the address it was sent to, from that address (its
    in_pktinfo): a socket bound to 0.0.0.0 would answer from the route's address, which
    is not the backend the gateway DNATed to, and its conntrack would not un-NAT it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, _IP_PKTINFO, 1)
    s.bind(("0.0.0.0", port))
    while True:
        _, ancillary, _, peer = s.recvmsg(2048, socket.CMSG_SPACE(_PKTINFO.size))
        for level, kind, data in ancillary:
            if level == socket.IPPROTO_IP and kind == _IP_PKTINFO:
                _, _, reached = _PKTINFO.unpack(data[:_PKTINFO.size])
                reply = _PKTINFO.pack(0, reached, bytes(4))
                s.sendmsg([socket.inet_ntoa(reached).encode()], [(socket.IPPROTO_IP, _IP_PKTINFO, reply)], 0, peer)


def cmd_serve_addr(args: argparse.Namespace) -> int:
    """Answer every connection with the address it was reached at (the backend the
    gateway chose, where the namespace holds many as local), one at a time; with --udp,
    datagrams to the same port too."""
    if args.udp:
        threading.Thread(target=_udp_echo_addr, args=(args.port,), daemon=True).start()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", args.port))
    s.listen(4096)
    print("ready", flush=True)
    while True:
        conn, _ = s.accept()
        try:
            conn.sendall(conn.getsockname()[0].encode())
        except OSError:
            pass
        conn.close()


def _timed_once(dst: str, port: int, sport: int, source: str) -> tuple[float, float, str]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(3.0)
        s.bind((source, sport))
        t0 = time.perf_counter()
        s.connect((dst, port))
        t1 = time.perf_counter()
        data = b""
        while chunk := s.recv(256):
            data += chunk
        return t1 - t0, time.perf_counter() - t0, data.decode()


def cmd_timed(args: argparse.Namespace) -> int:
    """--count fresh connections after --warmup, each from its own never reused source
    port: per connection the time of connect() (the SYN through the gateway's NAT rules,
    the SYN/ACK back) and of the whole exchange, and who answered."""
    connect, total, answers, errors = [], [], Counter(), []
    for k in range(args.warmup + args.count):
        sport = args.first_sport + k
        try:
            c, t, who = _timed_once(args.dst, args.port, sport, args.source)
        except OSError as err:
            errors.append(f"source port {sport}: {err}")
            continue
        if not who:
            errors.append(f"source port {sport}: empty answer")
        elif k >= args.warmup:
            connect.append(c)
            total.append(t)
            answers[who] += 1
    json.dump({"connect": connect, "total": total, "answers": dict(answers), "errors": errors[:20],
               "error_count": len(errors)}, sys.stdout)
    return 0


def cmd_reach(args: argparse.Namespace) -> int:
    """For each line "DST PORT" on stdin: connect over and over (a port with no DNAT is
    refused at once) until one is accepted; a JSON line with CLOCK_MONOTONIC of that
    connection (the machine's, the same in every namespace), or "at": null after 10 s."""
    _emit({"ready": True})
    for line in sys.stdin:
        dst, port = line.split()
        deadline, attempts, at = time.monotonic() + 10.0, 0, None
        while at is None and time.monotonic() < deadline:
            attempts += 1
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(0.2)
                try:
                    s.connect((dst, int(port)))
                    at = time.monotonic()
                except OSError:
                    time.sleep(0.0002)  # a fresh source port for the next try
        _emit({"port": int(port), "at": at, "attempts": attempts})
    return 0


def cmd_udp_ports(args: argparse.Namespace) -> int:
    """One datagram to each port lo..hi-1 from one socket (a conntrack flow each), in
    chunks of 100 the backend keeps up with; the unanswered asked again (the same flows),
    up to 5 rounds."""
    s = _udp_socket(None, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    answers: dict[int, str] = {}
    sent = 0
    for _ in range(5):
        missing = [p for p in range(args.lo, args.hi) if p not in answers]
        for start in range(0, len(missing), 100):
            part = missing[start:start + 100]
            for port in part:
                s.sendto(b"?", (args.dst, port))
            sent += len(part)
            deadline = time.monotonic() + 1.0
            while any(p not in answers for p in part) and time.monotonic() < deadline:
                s.settimeout(max(0.001, deadline - time.monotonic()))
                try:
                    data, (_, port) = s.recvfrom(2048)
                except socket.timeout:
                    break
                answers[port] = data.decode(errors="replace").strip()
        if len(answers) == args.hi - args.lo:
            break
    _emit({"ports": args.hi - args.lo, "sent": sent, "answered": len(answers),
           "by_backend": dict(Counter(answers.values())), "source_port": s.getsockname()[1]})
    return 0


# ----------------------------------------------------------------------- cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lab.traffic", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="TCP/UDP servers answering with a name")
    s.add_argument("--name", required=True)
    s.add_argument("--tcp-port", type=int, action="append", default=[])
    s.add_argument("--udp-port", type=int, action="append", default=[])
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("connect", help="sequential TCP connections, read the name")
    c.add_argument("--dst", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--count", type=int, default=1)
    c.add_argument("--source", action="append", help="local IP; repeat to round-robin")
    c.add_argument("--timeout", type=float, default=2.0)
    c.set_defaults(func=cmd_connect)

    u = sub.add_parser("udp", help="UDP queries, read the name")
    u.add_argument("--dst", required=True)
    u.add_argument("--port", type=int, required=True)
    u.add_argument("--count", type=int, default=1)
    u.add_argument("--source", action="append", help="local IP; repeat to round-robin")
    u.add_argument("--timeout", type=float, default=1.0)
    u.add_argument("--same-flow", action="store_true", help="reuse one socket for all queries")
    u.set_defaults(func=cmd_udp)

    f = sub.add_parser("stream", help="one UDP flow sending every --interval s; a line per answer")
    f.add_argument("--dst", required=True)
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--source", default=None, help="local IP")
    f.add_argument("--sport", type=int, default=0, help="local port (0: any)")
    f.add_argument("--interval", type=float, default=0.05)
    f.add_argument("--duration", type=float, default=120.0)
    f.set_defaults(func=cmd_stream)

    n = sub.add_parser("sniff", help="count distinct (src, sport) SYNs to --dport")
    n.add_argument("--iface", default="eth0")
    n.add_argument("--dport", type=int, default=8080)
    n.add_argument("--duration", type=float, default=120.0, help="max run time after ready")
    n.add_argument("--ready-timeout", type=float, default=10.0)
    n.add_argument("--ignore-source", action="append", default=[], help="leave out SYNs from this address")
    n.set_defaults(func=cmd_sniff)

    y = sub.add_parser("syn", help="send SYNs with distinct random source ports (scapy)")
    y.add_argument("--dst", required=True)
    y.add_argument("--dport", type=int, required=True)
    y.add_argument("--count", type=int, default=1)
    y.add_argument("--src", default="172.18.0.100")
    y.add_argument("--inter", type=float, default=0.0)
    y.set_defaults(func=cmd_syn)

    a = sub.add_parser("serve-addr", help="TCP server answering with the address it was reached at")
    a.add_argument("--port", type=int, default=8080)
    a.add_argument("--udp", action="store_true", help="also answer UDP datagrams to the port, from the address reached")
    a.set_defaults(func=cmd_serve_addr)

    t = sub.add_parser("timed", help="timed fresh TCP connections from distinct source ports")
    t.add_argument("--dst", required=True)
    t.add_argument("--port", type=int, required=True)
    t.add_argument("--count", type=int, required=True)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--first-sport", type=int, required=True)
    t.add_argument("--source", default="0.0.0.0")
    t.set_defaults(func=cmd_timed)

    r = sub.add_parser("reach", help="per stdin line DST PORT: connect until accepted")
    r.set_defaults(func=cmd_reach)

    q = sub.add_parser("udp-ports", help="a UDP datagram to each port of a range, answers counted")
    q.add_argument("--dst", required=True)
    q.add_argument("--lo", type=int, required=True)
    q.add_argument("--hi", type=int, required=True)
    q.set_defaults(func=cmd_udp_ports)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
