"""Run inside the client namespace: load for the resilience tests, as a child process.

  tcp DURATION EIP PORT [PORT ...]  new TCP connections back to back, ports in turn,
                                    each port from source addresses 172.18.0.101-120 in turn
  udp DURATION EIP PORT SRCPORT     one UDP flow (fixed source port), a datagram every 20 ms

Prints one JSON line when done: for tcp, counts per port and backend and every failure;
for udp, (seconds since start, backend) of every answer."""
from __future__ import annotations

import json
import socket
import sys
import time

CLIENTS = [f"172.18.0.{i}" for i in range(101, 121)]


def tcp(duration: float, eip: str, ports: list[int]) -> dict:
    answers: dict[str, dict[str, int]] = {str(p): {} for p in ports}
    failures: list[str] = []
    pinned: dict[str, dict[str, set[str]]] = {}
    end, n = time.monotonic() + duration, 0
    while time.monotonic() < end:
        # Every port sees every client: chosen together (both by n), port p would only see
        # the clients whose number has p's remainder (with 2 ports, 10 of the 20 each).
        port, source = ports[n % len(ports)], CLIENTS[(n // len(ports)) % len(CLIENTS)]
        n += 1
        try:
            with socket.create_connection((eip, port), timeout=1.0, source_address=(source, 0)) as conn:
                name = conn.recv(64).decode().strip()
            answers[str(port)][name] = answers[str(port)].get(name, 0) + 1
            pinned.setdefault(str(port), {}).setdefault(source, set()).add(name)
        except OSError as err:
            failures.append(f"{port} from {source}: {type(err).__name__}: {err}")
    return {"connections": n, "answers": answers, "failures": failures,
            "pinned": {p: {s: sorted(b) for s, b in by.items()} for p, by in pinned.items()}}


def udp(duration: float, eip: str, port: int, source_port: int) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("172.18.0.100", source_port))
    sock.settimeout(0.02)
    start = time.monotonic()
    answers = []
    while time.monotonic() - start < duration:
        sock.sendto(b"q", (eip, port))
        try:
            data, _ = sock.recvfrom(64)
            answers.append((round(time.monotonic() - start, 3), data.decode().strip()))
            time.sleep(0.02)
        except socket.timeout:
            pass
    return {"answers": answers}


if __name__ == "__main__":
    mode, duration, eip, *rest = sys.argv[1:]
    if mode == "tcp":
        result = tcp(float(duration), eip, [int(p) for p in rest])
    else:
        result = udp(float(duration), eip, int(rest[0]), int(rest[1]))
    print(json.dumps(result), flush=True)
