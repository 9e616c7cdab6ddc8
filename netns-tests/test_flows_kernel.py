"""Conntrack reconciled by state against the real kernel: ctnetlink's dumps and deletes
(agent/kernel/ctnetlink.py), a one-way UDP sender that began before its identity existed, and
the flows of many removed identities."""
from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime

from gwtest import BACKENDS, EIP, ROOT, WEB, Agent, program, rule_doc, wait_for, write_rules, yaml_docs
from lab.topology import Lab

STREAM_PORT = 5300
STREAM = [rule_doc(f"stream-{n}", STREAM_PORT, ip, 5353, proto="udp") for n, ip in BACKENDS.items()]


def entries(lab: Lab, port: int, proto: str = "udp") -> list[str]:
    out = lab.run_in(lab.gw_ns, ["conntrack", "-L", "-p", proto, "--orig-dst", EIP, "--dport", str(port)]).stdout
    return [line for line in out.splitlines() if "dst=" in line]


def synced_at(agent: Agent, identities: int) -> float:
    """Wall time of the agent's sync that left `identities` identities programmed."""
    for e in agent.logs():
        if e.get("event") == "synced" and e.get("identities") == identities:
            return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
    raise AssertionError("no such sync in the agent's log")


def test_a_one_way_sender_from_before_its_identity_is_balanced_at_once(lab: Lab, agent: Agent) -> None:
    program(agent, *WEB, identities=1)
    stream = lab.udp_stream(EIP, STREAM_PORT, interval=0.05)
    try:
        # No identity yet: the gateway itself is asked, answers nothing, and conntrack keeps
        # the flow's entry without NAT (refreshed by every datagram).
        old = wait_for(lambda: entries(lab, STREAM_PORT), what="the sender's entry")
        assert "src=172.18.0.10" in old[0].split("dport")[1], old  # answered by the EIP itself: no NAT
        time.sleep(0.3)
        program(agent, *WEB, *STREAM, identities=2)
        wait_for(lambda: any(f"src={ip}" in e for e in entries(lab, STREAM_PORT) for ip in BACKENDS.values()),
                 what="the flow NATed to a backend")
        time.sleep(0.3)
    finally:
        answers = stream.stop()
    appeared = synced_at(agent, 2)
    assert answers and {name for _, name in answers} <= set(BACKENDS), answers[:3]
    assert answers[0][0] - appeared < 1.0, (answers[0][0] - appeared)  # balanced within a second of the identity
    assert len(entries(lab, STREAM_PORT)) == 1  # one flow, now NATed (the stale entry went)
    cleaned = [e for e in agent.logs() if e.get("event") == "conntrack cleaned"]
    assert cleaned and cleaned[-1]["deleted"] >= 1 and cleaned[-1]["kernel_filtered"] is True


def test_ctnetlink_dumps_by_destination_and_deletes_only_what_it_names(lab: Lab) -> None:
    """The kernel filters a dump by destination, protocol and port; a delete by tuple and
    id takes exactly that entry, and one already gone counts as nothing."""
    for sport, dport, reply in ((1000, 53, "10.0.1.11"), (1001, 53, EIP), (1002, 54, EIP)):
        lab.run_in(lab.gw_ns, ["conntrack", "-I", "-p", "udp", "-s", "172.18.0.100", "-d", EIP, "--sport", str(sport),
                               "--dport", str(dport), "-r", reply, "-q", "172.18.0.100", "--reply-port-src",
                               str(5353 if reply != EIP else dport), "--reply-port-dst", str(sport),
                               "--timeout", "100"], check=True)
    code = ("import json\nfrom agent.kernel.ctnetlink import Conntrack\nfrom agent.core.flows import Query\n"
            f"ct = Conntrack()\nport53 = list(ct.flows(Query('{EIP}', 17, 53)))\nfiltered = ct.filtered\n"
            f"everything = list(ct.flows(Query('{EIP}', 17)))\ntcp = list(ct.flows(Query('{EIP}', 6)))\n"
            "stale = [f for f in port53 if f.backend is None]\n"
            "print(json.dumps({'port53': len(port53), 'filtered': filtered, 'all': len(everything),\n"
            " 'tcp': len(tcp), 'deleted': ct.delete(stale), 'again': ct.delete(stale),\n"
            " 'dumped': ct.dumped}))\n")
    out = json.loads(lab.run_in(lab.gw_ns, [sys.executable, "-c", code], cwd=ROOT, check=True).stdout)
    assert out == {"port53": 2, "filtered": True, "all": 3, "tcp": 0, "deleted": 1, "again": 0, "dumped": 5}
    assert len(entries(lab, 53)) == 1 and "src=10.0.1.11" in entries(lab, 53)[0]  # the NATed one stays
    assert len(entries(lab, 54)) == 1


def test_the_flows_of_many_removed_identities_go_and_another_change_lands(lab: Lab, agent: Agent) -> None:
    """2,000 identities with a flow each, removed at once, and another identity's change
    made right after: all their entries go (over netlink, in batches), the change lands."""
    n = 2000
    docs = [rule_doc(f"many-{p}", p, BACKENDS["b1"], 5353, proto="udp") for p in range(20000, 20000 + n)]
    write_rules(agent.rules_dir, "many.yaml", yaml_docs(*docs))
    program(agent, *WEB, identities=n + 1)
    sent = lab.run_in(lab.client_ns, [sys.executable, "-c", (
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"for p in range(20000, {20000 + n}):\n s.sendto(b'?', ('{EIP}', p))\n")], check=True)
    assert sent.returncode == 0
    wait_for(lambda: len(entries_toward_many(lab)) >= n * 0.95, timeout=10, what="a flow per identity")
    write_rules(agent.rules_dir, "many.yaml", "")
    time.sleep(0.2)  # while the removal's cleanup runs: another identity's change
    program(agent, *WEB, rule_doc("late", 81, BACKENDS["b2"]), identities=2)
    wait_for(lambda: not entries_toward_many(lab), timeout=10, what="every removed identity's flow gone")
    cleaned = [e for e in agent.logs() if e.get("event") == "conntrack cleaned" and e.get("gone") == n]
    assert cleaned and cleaned[0]["deleted"] >= n * 0.95, cleaned


def entries_toward_many(lab: Lab) -> list[str]:
    """Entries toward ports 20000-21999 of the EIP (the first dport of a line: the original's)."""
    out = lab.run_in(lab.gw_ns, ["conntrack", "-L", "-p", "udp", "--orig-dst", EIP]).stdout
    return [line for line in out.splitlines()
            if (m := re.search(r"dport=(\d+)", line)) and 20000 <= int(m.group(1)) < 22000]
