"""A busy neighbour: another table in the same network namespace committing every
`interval` seconds (as the legacy script's table does during a migration, or
iptables-nft, or any other nftables user in the pod). Run inside the namespace:

    python -m lab.neighbour [--interval 0.1] [--table neighbour]

Prints "ready" after its first commit, one JSON line of counts when it ends (stdin
closed, SIGTERM or SIGINT)."""
from __future__ import annotations

import argparse
import json
import select
import signal
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--table", default="neighbour")
    args = p.parse_args(argv)
    import nftables

    nft = nftables.Nftables()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    rc, _, err = nft.cmd(f"add table ip {args.table}\nadd set ip {args.table} s {{ type inet_service; }}")
    if rc != 0:
        print(err, file=sys.stderr)
        return 1
    print("ready", flush=True)
    commits = failures = 0
    started = time.monotonic()
    while not stop:
        verb = "add" if commits % 2 == 0 else "delete"
        rc, _, _ = nft.cmd(f"{verb} element ip {args.table} s {{ 4242 }}")
        commits += rc == 0
        failures += rc != 0
        ready, _, _ = select.select([sys.stdin], [], [], max(0.0, started + (commits + failures) * args.interval
                                                             - time.monotonic()))
        if ready and not sys.stdin.read(1):
            break  # stdin closed: the parent went
    nft.cmd(f"delete table ip {args.table}")
    print(json.dumps({"commits": commits, "failures": failures, "seconds": round(time.monotonic() - started, 3)}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
