"""Send one packet per (source address, protocol, port) to an address, from inside a
network namespace, by a raw socket (IP_HDRINCL): a TCP SYN or a UDP datagram with the
checksums right (conntrack checks them). Reads JSON {"target": ADDRESS, "packets":
[[source, "tcp"|"udp", port], ...]} on stdin; prints the count sent."""
from __future__ import annotations

import json
import socket
import struct
import sys


def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def packet(source: str, target: str, proto: str, port: int, sport: int) -> bytes:
    src, dst = socket.inet_aton(source), socket.inet_aton(target)
    if proto == "tcp":
        number, header = 6, struct.pack("!HHIIBBHHH", sport, port, 1, 0, 5 << 4, 0x02, 64240, 0, 0)
        at = 16
    else:
        number, header = 17, struct.pack("!HHHH", sport, port, 8, 0)
        at = 6
    pseudo = src + dst + struct.pack("!BBH", 0, number, len(header))
    header = header[:at] + struct.pack("!H", checksum(pseudo + header)) + header[at + 2:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(header), 0, 0, 64, number, 0, src, dst)
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    return ip + header


def main() -> None:
    job = json.load(sys.stdin)
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    for source, proto, port in job["packets"]:
        sock.sendto(packet(source, job["target"], proto, port, 40000), (job["target"], 0))
    print(len(job["packets"]))


if __name__ == "__main__":
    main()
