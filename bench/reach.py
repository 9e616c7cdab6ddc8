"""The footprint benchmark's client, run in the lab's client namespace: for each line
"EIP PORT" on stdin it connects to EIP:PORT over and over (the gateway answers a
connection to an EIP port with no DNAT by a reset, at once) until one is accepted, and
prints {"port": PORT, "at": CLOCK_MONOTONIC of that connection, "attempts": N} -- the
monotonic clock is the machine's, the same in every namespace. Gives up after 10 s
({"at": null})."""
from __future__ import annotations

import json
import socket
import sys
import time

GIVE_UP = 10.0


def reach(eip: str, port: int) -> dict[str, object]:
    deadline = time.monotonic() + GIVE_UP
    attempts = 0
    while time.monotonic() < deadline:
        attempts += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            try:
                s.connect((eip, port))
            except OSError:
                time.sleep(0.0002)  # refused at once: a fresh source port for the next try
                continue
            return {"port": port, "at": time.monotonic(), "attempts": attempts}
    return {"port": port, "at": None, "attempts": attempts}


def main() -> int:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        eip, port = line.split()
        print(json.dumps(reach(eip, int(port))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
