"""Run inside the client namespace by test_replicas.py: one TCP connection (or one UDP
exchange, on a connected socket) for each (source address, source port) given, each
answered by the backend it reached with the address it was reached at (lab.traffic
serve-addr). A source's connections go in turn; sources go side by side (a thread each),
so that a lab where two of three answers are lost (issue 29) costs seconds, not minutes.

stdin: {"eip": EIP, "port": PORT, "proto": "tcp"|"udp", "timeout": S, "connections": [[source, sport], ...]}
stdout: one JSON line, [[source, sport, answer or null, error or null], ...] in the order given"""
from __future__ import annotations

import json
import socket
import sys
import threading
from typing import Any


def tcp(eip: str, port: int, source: str, sport: int, timeout: float) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.bind((source, sport))  # a source port never used before in the test: see its ports()
        sock.connect((eip, port))
        data = b""
        while chunk := sock.recv(64):
            data += chunk
    return data.decode()


def udp(eip: str, port: int, source: str, sport: int, timeout: float) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.bind((source, sport))
        sock.connect((eip, port))  # connected: an answer from any other address (not un-NATed) is dropped
        sock.send(b"?")
        return sock.recv(64).decode()


def main() -> None:
    asked = json.load(sys.stdin)
    exchange = {"tcp": tcp, "udp": udp}[asked.get("proto", "tcp")]
    timeout = float(asked.get("timeout", 2.0))
    by_source: dict[str, list[int]] = {}
    for i, (source, _) in enumerate(asked["connections"]):
        by_source.setdefault(source, []).append(i)
    done: list[Any] = [None] * len(asked["connections"])

    def run(indexes: list[int]) -> None:
        for i in indexes:
            source, sport = asked["connections"][i]
            try:
                done[i] = [source, sport, exchange(asked["eip"], asked["port"], source, sport, timeout) or None, None]
            except OSError as err:
                done[i] = [source, sport, None, f"{type(err).__name__}: {err}"]

    threads = [threading.Thread(target=run, args=(indexes,)) for indexes in by_source.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(done))


if __name__ == "__main__":
    main()
