"""The consistent choice in the kernel, through the agent's own table (issue 21).

In a namespace of its own (always deleted), a veth pair loops packets back in: sent out of
ck0 to the EIP (untracked on the way out), they arrive on ck1, pass the agent's prerouting chain and are forwarded to
the backend they were DNATed to (a static neighbour: nothing answers), so conntrack holds,
per client, the backend the kernel chose. Raw packets (netns-tests/scripts/syn_sender.py)
come from as many source addresses as wanted.

- 1,000 client addresses with no pin: the kernel's choice is agent.core.consistent's
  (`choose`) for every one, and `natgw-agent show --client` says where a client goes
  before (its bucket) and after (its pin);
- an upgrade from the layout before the consistent choice (tests/fixtures/
  layout-24cfe50.nft: the examples as that agent left them, with pins): every pin stays,
  pinned clients keep their backend, new ones go by the table, and the next sync sends
  nothing;
- a bucket someone else deleted or changed is heard and repaired (its map read back with
  the others, folded, planned), without a full sync."""
from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from gwtest import EIP, GATEWAY, ROOT, TABLE, eip_doc, fresh_namespace, ns_run, rule_doc, yaml_docs
from agent.core.consistent import choose
from agent.core.model import Backend
from test_jhash_kernel import addresses

BACKENDS = [f"10.0.1.{i}" for i in range(11, 15)]
PORT, BACKEND_PORT = 5000, 5353
PROGRAM = """
import json, sys
from agent.sources.directory import DirectorySource
from agent.run.daemon import connected
from agent.settings import Settings
source = DirectorySource(sys.argv[1])
source.poll()
reconciler = connected(Settings(gateway=sys.argv[2], conntrack=False))
first = reconciler.sync(source.objects())
reconciler.request_full_sync()  # read the kernel back: what it holds must be what was planned
again = reconciler.sync(source.objects())
print(json.dumps({"first": first.commands, "again": again.commands, "identities": first.identities}))
"""
FIXTURE = ROOT / "tests" / "fixtures" / "layout-24cfe50.nft"
# Someone else deletes one bucket's element and changes another's; the agent's kernel view
# hears it and the repair writes back exactly those (read back through every bucket map).
DRIFT = """
import json, subprocess, sys
from agent.sources.directory import DirectorySource
from agent.kernel.view import KernelView
from agent.run.daemon import connected
from agent.settings import Settings
source = DirectorySource(sys.argv[1])
source.poll()
reconciler = connected(Settings(gateway=sys.argv[2], conntrack=False))
reconciler.sync(source.objects())
key = sys.argv[3]
subprocess.run(["nft", "-f", "-"], check=True, text=True, input=(
    f"delete element ip natgw chash_5 {{ {key} }}\\n"
    f"delete element ip natgw chash_7 {{ {key} }}\\n"
    f"add element ip natgw chash_7 {{ {key} : drop }}\\n"))
def kernel():  # a read of its own: the agent's view's read would supersede what it heard
    return KernelView("ip", "natgw", subscribe=False).read()
before = kernel() != reconciler.mirror
repaired = reconciler.check_drift()
print(json.dumps({"drifted": before, "full_sync_due": repaired, "repaired": kernel() == reconciler.mirror}))
"""


@contextlib.contextmanager
def looped() -> Iterator[str]:
    """A namespace whose packets to the EIP come back in through its prerouting hook."""
    with fresh_namespace("ngwck") as ns:
        for cmd in (["link", "set", "lo", "up"], ["link", "add", "ck0", "type", "veth", "peer", "name", "ck1"],
                    ["link", "set", "ck0", "up"], ["link", "set", "ck1", "up"],
                    ["route", "add", f"{EIP}/32", "dev", "ck0"], ["route", "add", "10.0.1.0/24", "dev", "ck1"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
        ns_run(ns, "sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
               "net.ipv4.conf.default.rp_filter=0", "net.ipv4.conf.ck0.rp_filter=0", "net.ipv4.conf.ck1.rp_filter=0")
        # Untracked on the way out, so conntrack meets each packet first on the way back in,
        # where the agent's NAT chain sees it (else the entry made at output is not new).
        ns_run(ns, "nft", "-f", "-", stdin="table ip loop {\n chain out {\n  type filter hook output priority raw;"
                                          " policy accept;\n  notrack\n }\n}\n")
        mac = json.loads(ns_run(ns, "ip", "-j", "link", "show", "ck1"))[0]["address"]
        subprocess.run(["ip", "-n", ns, "neigh", "add", EIP, "lladdr", mac, "dev", "ck0", "nud", "permanent"], check=True)
        for i, backend in enumerate(BACKENDS):
            subprocess.run(["ip", "-n", ns, "neigh", "add", backend, "lladdr", f"02:00:00:00:01:{i:02x}", "dev", "ck1",
                            "nud", "permanent"], check=True)
        yield ns


def program(ns: str, rules: Path) -> dict[str, int]:
    result: dict[str, int] = json.loads(ns_run(ns, sys.executable, "-c", PROGRAM, str(rules), GATEWAY).strip()
                                        .splitlines()[-1])
    return result


def send(ns: str, packets: list[tuple[str, str, int]]) -> None:
    ns_run(ns, sys.executable, str(ROOT / "netns-tests" / "scripts" / "syn_sender.py"),
           stdin=json.dumps({"target": EIP, "packets": packets}))


def shown(ns: str, client: str) -> dict[str, object]:
    """`natgw-agent show --client` for the one identity, as JSON."""
    out = json.loads(ns_run(ns, sys.executable, "-m", "agent.cli", "show", "--json", "--client", client))
    [identity] = out["identities"]
    answer: dict[str, object] = identity["client"]
    return answer


def chosen(ns: str, proto: str, port: int) -> dict[str, str]:
    """Client -> the backend conntrack says its packet to EIP:port was DNATed to."""
    out = ns_run(ns, "conntrack", "-L", "-p", proto, "--orig-dst", EIP, "--dport", str(port))
    found = {}
    for line in out.splitlines():
        if m := re.search(r"src=(\S+) dst=\S+ sport=\d+ dport=\d+ .*?src=(\S+)", line):
            found[m[1]] = m[2]
    return found


def test_the_kernel_chooses_as_the_model_for_1000_clients(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml_docs(eip_doc(), *(
        rule_doc(f"udp-{i}", PORT, ip, BACKEND_PORT, proto="udp", affinity="ClientIP", timeout=600)
        for i, ip in enumerate(BACKENDS))))
    clients = addresses(1000)
    with looped() as ns:
        result = program(ns, tmp_path)
        assert result["first"] > 0 and result["again"] == 0 and result["identities"] == 1, result
        fresh = addresses(1010)[1000:]  # clients that sent nothing: no pin
        before = {c: shown(ns, c) for c in fresh[:5]}
        send(ns, [(c, "udp", PORT) for c in clients])
        seen = chosen(ns, "udp", PORT)
        after = {c: shown(ns, c) for c in clients[:5]}
    assert len(seen) == len(clients), f"{len(seen)} of {len(clients)} packets were NATed"
    backends = [Backend(ip, BACKEND_PORT) for ip in BACKENDS]
    wrong = {c: (seen[c], choose(backends, c).ip) for c in clients if seen[c] != choose(backends, c).ip}
    assert not wrong, f"{len(wrong)} of {len(clients)} clients not where the model says, e.g. {list(wrong.items())[:5]}"
    # show --client: an unpinned client's bucket and a pinned one's pin, as the kernel did
    for c, answer in before.items():
        assert not answer["pinned"] and answer["backend"] == answer["expected"] == str(choose(backends, c)), answer
    for c, answer in after.items():
        assert answer["pinned"] and answer["backend"] == f"{seen[c]}:{BACKEND_PORT}", answer
    shares = {ip: sum(v == ip for v in seen.values()) / len(clients) for ip in BACKENDS}
    assert all(abs(share - 0.25) < 0.06 for share in shares.values()), shares  # and the choice spreads


def test_an_upgrade_from_the_layout_before_keeps_every_pin() -> None:
    """The examples' ClientIP identity 172.18.0.10:443/tcp, backends 10.0.1.11-13:9090 in
    slots 0-2, as the agent before the consistent choice programmed it, with clients
    pinned to each slot; then this agent takes the table over."""
    identity = ("172.18.0.10", "tcp", 443)
    backends = [Backend(f"10.0.1.{11 + s}", 9090) for s in range(3)]
    clients = addresses(300)
    pinned = {c: i % 3 for i, c in enumerate(clients[:30])}  # 10 per slot, most not where the table sends them
    with looped() as ns:
        ns_run(ns, "nft", "-f", str(FIXTURE))
        pins = "\n".join(f"add element ip {TABLE} aff_{s} {{ {c} . {' . '.join(map(str, identity))} timeout 10m }}"
                         for c, s in pinned.items())
        ns_run(ns, "nft", "-f", "-", stdin=pins + "\n")
        result = program(ns, ROOT / "examples")
        assert result["first"] > 0 and result["again"] == 0, result  # upgraded, and the kernel holds what was planned
        kept = {}
        for s in range(3):
            listing = json.loads(ns_run(ns, "nft", "-j", "list", "set", "ip", TABLE, f"aff_{s}"))
            for obj in listing["nftables"]:
                for elem in obj.get("set", {}).get("elem", []):
                    kept[elem["elem"]["val"]["concat"][0]] = s
        assert kept == pinned, "pins lost or moved in the upgrade"
        send(ns, [(c, "tcp", 443) for c in clients])
        seen = chosen(ns, "tcp", 443)
    assert len(seen) == len(clients), f"{len(seen)} of {len(clients)} packets were NATed"
    moved = {c: seen[c] for c, s in pinned.items() if seen[c] != backends[s].ip}
    assert not moved, f"pinned clients moved: {moved}"
    against = sum(choose(backends, c) != backends[s] for c, s in pinned.items())
    assert against >= 10  # the pins, not the table, kept them: the check above could fail
    wrong = {c: seen[c] for c in clients[30:] if seen[c] != choose(backends, c).ip}
    assert not wrong, f"{len(wrong)} new clients not where the table says: {wrong}"


def test_a_bucket_someone_else_changed_is_repaired(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml_docs(eip_doc(), *(
        rule_doc(f"udp-{i}", PORT, ip, BACKEND_PORT, proto="udp", affinity="ClientIP", timeout=600)
        for i, ip in enumerate(BACKENDS))))
    with looped() as ns:
        out = ns_run(ns, sys.executable, "-c", DRIFT, str(tmp_path), GATEWAY, f"{EIP} . udp . {PORT}")
    assert json.loads(out.strip().splitlines()[-1]) == {"drifted": True, "full_sync_due": False, "repaired": True}
