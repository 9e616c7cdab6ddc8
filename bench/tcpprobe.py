"""TCP server and client for the data-plane benchmark, each run inside its namespace.

server: accepts on 0.0.0.0:PORT and answers every connection with the address it was
reached at (the backend the gateway chose), then closes.
client: N fresh connections (each from its own, never reused source port) to EIP:PORT,
one after another; per connection the time of connect() (the SYN crosses the gateway's
NAT rules, the SYN/ACK comes back) and of the whole exchange (connect, answer, EOF).
Prints JSON: the times and the backends that answered."""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections import Counter


def serve(port: int) -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(4096)
    print("ready", flush=True)
    while True:
        conn, _ = s.accept()
        try:
            conn.sendall(conn.getsockname()[0].encode())
        except OSError:
            pass
        conn.close()


def _one(eip: str, port: int, sport: int, source: str) -> tuple[float, float, str]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(3.0)
        s.bind((source, sport))
        t0 = time.perf_counter()
        s.connect((eip, port))
        t1 = time.perf_counter()
        chunks = []
        while True:
            data = s.recv(256)
            if not data:
                break
            chunks.append(data)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, b"".join(chunks).decode()
    finally:
        s.close()


def client(eip: str, port: int, count: int, warmup: int, first_sport: int, source: str) -> int:
    connect, total, answers, errors = [], [], Counter(), []
    sport = first_sport
    for k in range(warmup + count):
        try:
            c, t, who = _one(eip, port, sport, source)
        except OSError as err:
            errors.append(f"source port {sport}: {err}")
            who = ""
        else:
            if not who:
                errors.append(f"source port {sport}: empty answer")
        sport += 1
        if who and k >= warmup:
            connect.append(c)
            total.append(t)
            answers[who] += 1
    json.dump({"connect": connect, "total": total, "answers": dict(answers), "errors": errors[:20],
               "error_count": len(errors)}, sys.stdout)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server")
    s.add_argument("--port", type=int, default=8080)
    c = sub.add_parser("client")
    c.add_argument("--eip", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--count", type=int, required=True)
    c.add_argument("--warmup", type=int, default=20)
    c.add_argument("--first-sport", type=int, required=True)
    c.add_argument("--source", default="0.0.0.0")
    args = p.parse_args()
    if args.cmd == "server":
        return serve(args.port)
    return client(args.eip, args.port, args.count, args.warmup, args.first_sport, args.source)


if __name__ == "__main__":
    sys.exit(main())
