"""Run inside the client namespace by test_replicas.py: one TCP connection for each
(source address, source port) given, in turn, each answered by the backend it reached
with the address it was reached at (lab.traffic serve-addr).

stdin: {"eip": EIP, "port": PORT, "connections": [[source, sport], ...]}
stdout: one JSON line, [[source, sport, answer or null, error or null], ...]"""
from __future__ import annotations

import json
import socket
import sys


def connect(eip: str, port: int, source: str, sport: int) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        sock.bind((source, sport))  # a source port never used before in the test: see its ports()
        sock.connect((eip, port))
        data = b""
        while chunk := sock.recv(64):
            data += chunk
    return data.decode()


def main() -> None:
    asked = json.load(sys.stdin)
    done = []
    for source, sport in asked["connections"]:
        try:
            done.append([source, sport, connect(asked["eip"], asked["port"], source, sport) or None, None])
        except OSError as err:
            done.append([source, sport, None, f"{type(err).__name__}: {err}"])
    print(json.dumps(done))


if __name__ == "__main__":
    main()
