"""Clients inside the VPC reaching an EIP (the path kube-ovn's own e2e tests of share DNAT
take): in on the gateway's eth0, DNAT, out on eth0 again. The backend must see the EIP as
the source, or it answers the client directly and the client drops the answer. Tested with
kube-ovn's own hairpin rules (iptables, what `eip-add` installs), with the agent's
--hairpin-snat, and with both. And --masquerade (an HA gateway's replicas, issue 29): every
flow the agent DNATs leaves eth0 from the gateway's own address, hairpin flows included,
SNATed once beside kube-ovn's hairpin rule."""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from gwtest import (APP, BACKENDS, CLIENTS, DNS, EIP, ROOT, WEB, Agent, program, reply_destinations, run_agent,
                    wait_for)
from lab.topology import GW_BACKEND_IP, Lab

VPC_CLIENTS = [f"10.0.1.{i}" for i in range(51, 61)]


@pytest.fixture
def vpc_lab() -> Iterator[Lab]:
    with Lab(vpc_client=True) as built:
        yield built


def start_agent(lab: Lab, tmp_path: Path, *extra: str) -> Iterator[Agent]:
    rules = tmp_path / "rules"
    rules.mkdir()
    yield from run_agent(Agent(lab, rules, tmp_path / "agent.log", ["--from-dir", str(rules), *extra]))


@pytest.fixture
def agent(vpc_lab: Lab, tmp_path: Path) -> Iterator[Agent]:
    yield from start_agent(vpc_lab, tmp_path)


@pytest.fixture
def hairpin_agent(vpc_lab: Lab, tmp_path: Path) -> Iterator[Agent]:
    yield from start_agent(vpc_lab, tmp_path, "--hairpin-snat")


def kube_ovn_hairpin(lab: Lab, eip: str = EIP) -> None:
    """What kube-ovn's gateway installs for an EIP (nat-gateway.sh eip-add), in iptables."""
    for argv in (["-t", "mangle", "-A", "PREROUTING", "-i", "eth0", "-j", "MARK", "--set-xmark", "0x1/0x1"],
                 ["-t", "nat", "-A", "POSTROUTING", "-m", "mark", "--mark", "0x1/0x1", "-o", "eth0", "-m",
                  "conntrack", "--ctstate", "DNAT", "--ctorigdst", eip, "-j", "SNAT", "--to-source", eip,
                  "--random-fully"]):
        lab.run_in(lab.gw_ns, ["iptables", *argv], check=True)


def kube_ovn_snat_packets(lab: Lab) -> int:
    out = lab.run_in(lab.gw_ns, ["iptables", "-t", "nat", "-L", "POSTROUTING", "-v", "-n", "-x"], check=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if "SNAT" in line)


def served_from_the_vpc(lab: Lab, source: str = EIP) -> None:
    """Random TCP, ClientIP and UDP, from clients beside the backends; the backends see
    `source` (the hairpin SNAT's EIP, or the gateway's own address with --masquerade)."""
    assert lab.vpc_ns is not None
    web = lab.tcp_connect(EIP, 80, 60, ns=lab.vpc_ns)
    assert web["failed"] == 0 and set(n for n, c in web["by_backend"].items() if c) == set(BACKENDS), web
    app = lab.tcp_connect(EIP, 443, 40, sources=VPC_CLIENTS, ns=lab.vpc_ns)
    assert app["failed"] == 0, app
    assert all(len(per) == 1 for per in app["by_source"].values()), app["by_source"]  # each client sticks
    dns = lab.udp_query(EIP, 53, 30, ns=lab.vpc_ns)
    assert dns["failed"] == 0 and all(dns["by_backend"][n] for n in BACKENDS), dns
    assert reply_destinations(lab, "tcp", lab.vpc_client_ip, 80) == {source}  # SNATed, once


def test_without_a_hairpin_snat_a_vpc_client_gets_no_answer(vpc_lab: Lab, agent: Agent) -> None:
    program(agent, *WEB, identities=1)
    assert vpc_lab.tcp_connect(EIP, 80, 3, timeout=1.0)["failed"] == 0  # from outside: served
    inside = vpc_lab.tcp_connect(EIP, 80, 3, timeout=1.0, ns=vpc_lab.vpc_ns)
    assert inside["failed"] == 3, inside  # the backend answers the client directly: dropped


def test_kube_ovns_own_hairpin_rules_serve_vpc_clients(vpc_lab: Lab, agent: Agent) -> None:
    kube_ovn_hairpin(vpc_lab)
    program(agent, *WEB, *APP, *DNS, identities=3)
    served_from_the_vpc(vpc_lab)
    assert kube_ovn_snat_packets(vpc_lab) > 0


def test_the_agents_hairpin_snat_serves_vpc_clients_only(vpc_lab: Lab, hairpin_agent: Agent) -> None:
    program(hairpin_agent, *WEB, *APP, *DNS, identities=3)
    served_from_the_vpc(vpc_lab)
    outside = vpc_lab.tcp_connect(EIP, 80, 10)
    assert outside["failed"] == 0
    # An outside client keeps its own address toward the backend: no SNAT for it.
    assert reply_destinations(vpc_lab, "tcp", vpc_lab.client_ip, 80) == {vpc_lab.client_ip}
    # Only the agent's identities: a VPC flow to another port of the EIP is not SNATed.
    vpc_lab.run_in(vpc_lab.gw_ns, ["iptables", "-t", "nat", "-A", "PREROUTING", "-d", EIP, "-p", "tcp", "--dport",
                                   "8000", "-j", "DNAT", "--to-destination", f"{BACKENDS['b1']}:8080"], check=True)
    assert vpc_lab.tcp_connect(EIP, 8000, 2, timeout=1.0, ns=vpc_lab.vpc_ns)["failed"] == 2
    assert reply_destinations(vpc_lab, "tcp", vpc_lab.vpc_client_ip, 8000) == {vpc_lab.vpc_client_ip}


SNAT_LINES = {
    "--hairpin-snat": ['iifname "eth0" meta mark set meta mark | 0x00004000',
                       "snat to ct original ip daddr fully-random"],
    "--masquerade": ["ct mark set ct mark | 0x00004000",
                     'oifname "eth0" ct mark & 0x00004000 == 0x00004000 masquerade fully-random'],
}


@pytest.mark.parametrize("flags", [["--hairpin-snat"], ["--masquerade"], ["--hairpin-snat", "--masquerade"]],
                         ids="+".join)
def test_the_snat_table_reads_back_as_programmed(vpc_lab: Lab, tmp_path: Path, flags: list[str]) -> None:
    """Every nftables version: the marks, the ct expressions, the SNAT and masquerade flags
    are read back by meaning, so a restarted agent finds nothing to send, `diff` given no
    flag plans with the running agent's (its status says them) and finds nothing either,
    and a postrouting chain someone flushed is put back (drift repair)."""
    for agent in start_agent(vpc_lab, tmp_path, *flags):
        program(agent, *WEB, *APP, identities=2)
        before = agent.nft("-s", "list", "table", "ip", "natgw")
        for flag in flags:
            assert all(line in before for line in SNAT_LINES[flag]), before
        synced = len([e for e in agent.logs() if e.get("event") == "synced"])
        assert agent.stop(signal.SIGTERM) == 0
        agent.start()
        wait_for(lambda: len([e for e in agent.logs() if e.get("event") == "starting"]) == 2, what="the restart")
        time.sleep(1.0)
        assert len([e for e in agent.logs() if e.get("event") == "synced"]) == synced
        assert not [e for e in agent.logs() if e.get("event", "").startswith("drift")]
        assert agent.nft("-s", "list", "table", "ip", "natgw") == before
        started = [e for e in agent.logs() if e.get("event") == "starting"][-1]
        assert started["masquerade"] == ("eth0" if "--masquerade" in flags else False)
        diff = vpc_lab.run_in(vpc_lab.gw_ns, [sys.executable, "-m", "agent.cli", "diff", "--gateway", "gw1",
                                              "--from-dir", str(agent.rules_dir), "--state-dir", str(agent.state_dir)],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert (diff.returncode, diff.stdout) == (0, ""), diff.stderr
        agent.nft("flush", "chain", "ip", "natgw", "postrouting")
        wait_for(lambda: agent.nft("-s", "list", "table", "ip", "natgw") == before, 10, 0.1,
                 what="the postrouting chain repaired")


def test_with_both_hairpin_snats_a_flow_is_snated_once(vpc_lab: Lab, hairpin_agent: Agent) -> None:
    """kube-ovn's rule and the agent's together: the agent's chain (srcnat - 1) binds
    first, and a flow, once SNATed, is never SNATed again by a later chain."""
    kube_ovn_hairpin(vpc_lab)
    program(hairpin_agent, *WEB, *APP, *DNS, identities=3)
    served_from_the_vpc(vpc_lab)
    assert kube_ovn_snat_packets(vpc_lab) == 0  # kube-ovn's rule never had a flow to bind


@pytest.fixture
def masquerade_agent(vpc_lab: Lab, tmp_path: Path) -> Iterator[Agent]:
    yield from start_agent(vpc_lab, tmp_path, "--masquerade")


def pinned_clients(agent: Agent, identity: str) -> int:
    """The clients the kernel's affinity sets pin to this identity (`show --json`)."""
    out = agent.lab.run_in(agent.ns, [sys.executable, "-m", "agent.cli", "show", "--json", "--identity", identity,
                                      "--state-dir", str(agent.state_dir)], capture_output=True, text=True, cwd=ROOT,
                           check=True, timeout=30).stdout
    shown = json.loads(out)
    assert shown["masquerade"] == "eth0", shown["masquerade"]  # show says it, from the kernel's table
    return sum(b["pinned_clients"] for i in shown["identities"] for b in i["backends"])


def test_masquerade_serves_every_client_from_the_gateways_address_snated_once(vpc_lab: Lab,
                                                                               masquerade_agent: Agent) -> None:
    """Beside kube-ovn's own hairpin rules (its mangle mark 0x1 on eth0 and HAIRPIN_SNAT):
    outside and VPC clients, random TCP, ClientIP and UDP, each reaches its backends from
    the gateway's eth0 address. One SNAT per flow: the agent's chain binds first, so
    kube-ovn's rule counts no packet. Pins are still the clients' own addresses, and a DNAT
    of kube-ovn's own (an exclusive rule) is not the agent's to SNAT."""
    kube_ovn_hairpin(vpc_lab)
    program(masquerade_agent, *WEB, *APP, *DNS, identities=3)
    served_from_the_vpc(vpc_lab, source=GW_BACKEND_IP)
    web = vpc_lab.tcp_connect(EIP, 80, 30)
    assert web["failed"] == 0 and all(web["by_backend"][n] for n in BACKENDS), web
    app = vpc_lab.tcp_connect(EIP, 443, 40, sources=CLIENTS)
    assert app["failed"] == 0 and all(len(per) == 1 for per in app["by_source"].values()), app
    dns = vpc_lab.udp_query(EIP, 53, 30)
    assert dns["failed"] == 0 and all(dns["by_backend"][n] for n in BACKENDS), dns
    for proto, port in (("tcp", 80), ("tcp", 443), ("udp", 53)):
        assert reply_destinations(vpc_lab, proto, vpc_lab.client_ip, port) <= {GW_BACKEND_IP}
    assert reply_destinations(vpc_lab, "tcp", vpc_lab.client_ip, 80) == {GW_BACKEND_IP}
    assert kube_ovn_snat_packets(vpc_lab) == 0  # kube-ovn's hairpin rule never had a flow to bind
    # The choice still saw each client: 20 outside and 10 VPC clients, each pinned under its own address.
    assert pinned_clients(masquerade_agent, f"{EIP}:443/tcp") == len(CLIENTS) + len(VPC_CLIENTS)
    vpc_lab.run_in(vpc_lab.gw_ns, ["iptables", "-t", "nat", "-A", "PREROUTING", "-d", EIP, "-p", "tcp", "--dport",
                                   "8000", "-j", "DNAT", "--to-destination", f"{BACKENDS['b1']}:8080"], check=True)
    assert vpc_lab.tcp_connect(EIP, 8000, 2)["failed"] == 0
    assert reply_destinations(vpc_lab, "tcp", vpc_lab.client_ip, 8000) == {vpc_lab.client_ip}
