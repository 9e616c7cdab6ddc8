"""Self-test of the lab itself (lab.topology), without any natgw agent.

If these fail, the data-plane tests cannot be trusted: the topology, the
backend servers, the traffic generators and the sniffers are checked here
against a hand-written DNAT ruleset.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator

import pytest

from lab.topology import Lab, cleanup_stale

EIP = "172.18.0.10"

# nft 1.0.6 rejects "... dnat to 10.0.1.12:5353 }" on one line (it wants a
# newline or ";" before "}"), so the ruleset is written one statement a line.
HAND_DNAT = """\
table ip labtest {
    chain pre {
        type nat hook prerouting priority -100;
        ip daddr 172.18.0.10 tcp dport 80 dnat to 10.0.1.11:8080
        ip daddr 172.18.0.10 udp dport 53 dnat to 10.0.1.12:5353
    }
}
"""


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def lab_once() -> Iterator[Lab]:
    with Lab() as lab:
        yield lab


def test_topology_builds_and_tears_down() -> None:
    lab = Lab()
    with lab:
        assert set(lab.namespaces) <= _netns()
        gw_addrs = lab.run_in(lab.gw_ns, ["ip", "-br", "addr", "show"], check=True).stdout
        for cidr in ("172.18.0.1/24", "172.18.0.10/24", "172.18.0.11/24", "10.0.1.1/24"):
            assert cidr in gw_addrs
        bridge_ports = lab.run_in(lab.gw_ns, ["ip", "-br", "link", "show", "master", "eth0"], check=True).stdout
        assert len(bridge_ports.splitlines()) == 3
        forward = lab.run_in(lab.gw_ns, ["sysctl", "-n", "net.ipv4.ip_forward"], check=True).stdout
        assert forward.strip() == "1"
        # A live lab is never taken for a stale one.
        assert not set(cleanup_stale()) & set(lab.namespaces)
    assert not {ns for ns in _netns() if ns.startswith(lab.id)}
    lab.close()  # idempotent


def test_cleanup_stale_only_deletes_lab_shaped_names() -> None:
    stale = f"ngw{secrets.token_hex(3)}-b1"
    foreign = f"ngw{secrets.token_hex(3)}-other"
    try:
        for ns in (stale, foreign):
            subprocess.run(["ip", "netns", "add", ns], check=True)
        assert foreign not in cleanup_stale()
        assert stale not in _netns() and foreign in _netns()
    finally:
        for ns in (stale, foreign):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def test_backends_answer_from_gateway(lab_once: Lab) -> None:
    lab = lab_once
    for name, ip in zip(lab.backend_names, lab.backend_ips):
        for port in (8080, 9090):
            tcp = lab.tcp_connect(ip, port, 3, ns=lab.gw_ns)
            assert tcp["failed"] == 0, tcp
            assert tcp["by_backend"][name] == 3, tcp
        udp = lab.udp_query(ip, 5353, 3, ns=lab.gw_ns)
        assert udp["failed"] == 0, udp
        assert udp["by_backend"][name] == 3, udp


def test_client_has_no_route_to_backends(lab_once: Lab) -> None:
    result = lab_once.tcp_connect(lab_once.backend_ips[0], 8080, 1, timeout=0.5)
    assert result["failed"] == 1 and result["errors"] == {"ENETUNREACH": 1}, result


def test_hand_written_dnat(lab_once: Lab) -> None:
    lab = lab_once
    lab.run_in(lab.gw_ns, ["nft", "-f", "-"], input=HAND_DNAT, check=True)
    try:
        tcp = lab.tcp_connect(EIP, 80, 20)
        assert tcp["by_backend"] == {"b1": 20, "b2": 0, "b3": 0} and tcp["failed"] == 0, tcp

        sources = lab.client_extra_ips[:4]
        tcp = lab.tcp_connect(EIP, 80, 8, sources=sources)
        assert tcp["by_source"] == {src: {"b1": 2} for src in sources}, tcp

        udp = lab.udp_query(EIP, 53, 10)
        assert udp["by_backend"] == {"b1": 0, "b2": 10, "b3": 0} and udp["failed"] == 0, udp
        udp = lab.udp_query_same_flow(EIP, 53, 5)
        assert udp["by_backend"]["b2"] == 5 and len(udp["by_source"]) == 1, udp

        syn = lab.scapy_syn_spread(EIP, 80, 50)
        assert syn == {"by_backend": {"b1": 50, "b2": 0, "b3": 0}, "sent": 50}
    finally:
        lab.run_in(lab.gw_ns, ["nft", "delete", "table", "ip", "labtest"])
