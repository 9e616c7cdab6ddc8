"""`make run`: the agent on its embedded default, end to end.

Builds a gateway in network namespaces (a client on the EIP side, the gateway with its
EIPs on net1, three backends behind eth0), runs the agent in the gateway namespace on
the rules in examples/, sends real traffic, prints the per-backend counts and the
stickiness, takes a backend down and back (the agent's health checks), shows the ruleset,
and removes everything again, also on Ctrl-C."""
from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from agent.core.layout import SERVICES
from agent.settings import Settings
from lab.topology import Lab, cleanup_stale

ROOT = Path(__file__).resolve().parent.parent
EIP = "172.18.0.10"
CLIENTS = [f"172.18.0.{i}" for i in range(101, 121)]


def _bar(count: int, total: int) -> str:
    return "#" * round(40 * count / total) if total else ""


def _print_spread(title: str, result: dict) -> None:
    total = sum(result["by_backend"].values())
    print(f"\n{title}: {total} answered, {result['failed']} failed")
    for name, count in sorted(result["by_backend"].items()):
        print(f"  {name}  {count:4d}  {_bar(count, total)}")


def _wait_identities(lab: Lab, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = lab.run_in(lab.gw_ns, ["nft", "-j", "list", "map", "ip", Settings.table, SERVICES],
                         capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.count('"goto"') >= count:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the agent did not program {count} identities within {timeout}s")


def _interrupt(*_: object) -> None:
    # SIGTERM unwinds like Ctrl-C, through the cleanup below.
    raise KeyboardInterrupt


def main() -> int:
    cleanup_stale()
    rules = Path(tempfile.mkdtemp(prefix="natgw-demo-"))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with Lab() as lab:
            print(f"gateway namespace {lab.gw_ns}: EIP {EIP} on net1, backends {', '.join(lab.backend_ips)} behind eth0")
            for path in sorted((ROOT / "examples").iterdir()):
                shutil.copy(path, rules / path.name)
            print(f"rules from {rules}: {', '.join(sorted(p.name for p in rules.iterdir()))}")
            argv = [sys.executable, "-m", "agent.cli", "--log-format", "console", "run",
                    "--gateway", "gw1", "--from-dir", str(rules)]
            agent = lab.popen_in(lab.gw_ns, argv, cwd=ROOT)
            try:
                _traffic(lab)
            finally:
                # Stop the agent before its namespace goes; its rules would stay otherwise.
                agent.terminate()
                agent.wait(timeout=5)
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(rules, ignore_errors=True)
    print("\ndone: namespaces removed")
    return 0


def _traffic(lab: Lab) -> None:
    _wait_identities(lab, 3)

    _print_spread(f"TCP {EIP}:80 (stateless, 300 new connections)", lab.tcp_connect(EIP, 80, 300))
    _print_spread(f"UDP {EIP}:53 (stateless, 150 new flows)", lab.udp_query(EIP, 53, 150))
    one = lab.tcp_connect(EIP, 443, 30, sources=["172.18.0.100"])
    _print_spread(f"TCP {EIP}:443 ClientIP, one client, 30 connections", one)
    many = lab.tcp_connect(EIP, 443, 60, sources=CLIENTS)
    _print_spread(f"TCP {EIP}:443 ClientIP, 20 clients x 3 connections", many)
    sticky = sum(1 for per in many["by_source"].values() if len(per) == 1)
    print(f"  {sticky} of {len(many['by_source'])} clients stayed on one backend")

    _health(lab)

    for title, argv in (("natgw-agent show", [sys.executable, "-m", "agent.cli", "show"]),
                        (f"nft list table ip {Settings.table}", ["nft", "list", "table", "ip", Settings.table])):
        out = lab.run_in(lab.gw_ns, argv, cwd=ROOT, capture_output=True, text=True)
        print(f"\n$ {title}\n{out.stdout}{out.stderr}", end="")


def _served(lab: Lab, identity: str) -> set[str]:
    """The backends the kernel holds for an identity, as `natgw-agent show --json` reads them."""
    out = lab.run_in(lab.gw_ns, [sys.executable, "-m", "agent.cli", "show", "--json"], cwd=ROOT, capture_output=True,
                     text=True)
    found = json.loads(out.stdout)["identities"] if out.returncode == 0 else None
    return {b["backend"] for i in found or [] if i["identity"] == identity for b in i["backends"]}


def _until(what: str, done: Callable[[], bool], timeout: float = 10.0) -> None:
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)
    print(f"  {what}: after {time.monotonic() - started:.1f} s")


def _health(lab: Lab) -> None:
    """The agent's health checks: b2 refuses :8080, leaves the choice, and comes back."""
    b2 = f"{lab.backend_ips[1]}:8080"
    print(f"\nb2 refuses connections to :8080 (as if its web server died); the agent checks every backend")
    lab.run_in(lab.backend_ns[1], ["nft", "add table ip demo; add chain ip demo in { type filter hook input priority 0; };"
                                   " add rule ip demo in tcp dport 8080 reject with tcp reset"], check=True)
    _until(f"{b2} out of {EIP}:80", lambda: b2 not in _served(lab, f"{EIP}:80/tcp"))
    _print_spread(f"TCP {EIP}:80 with b2 down (150 new connections)", lab.tcp_connect(EIP, 80, 150))
    lab.run_in(lab.backend_ns[1], ["nft", "delete table ip demo"], check=True)
    print("b2 answers again")
    _until(f"{b2} back in {EIP}:80", lambda: b2 in _served(lab, f"{EIP}:80/tcp"))


if __name__ == "__main__":
    sys.exit(main())
