"""End to end through the Kubernetes path: the fake API server listens inside the gateway
namespace (as the API would be reached from the pod), the agent watches it, and real
traffic shows what it programmed."""
from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from pyroute2.netns import create_socket

from gwtest import BACKENDS, EIP, Agent, eip_doc, probe, rule_doc, run_agent, wait_for
from tests.kubefake import FakeKube

API_PORT = 16443


@pytest.fixture
def fake_api(lab) -> Iterator[FakeKube]:
    sock = create_socket(lab.gw_ns, socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", API_PORT))
    sock.listen(64)
    with FakeKube(sock, bookmark_interval=1.0) as fake:
        yield fake


@pytest.fixture
def kube_agent(lab, fake_api: FakeKube, tmp_path: Path) -> Iterator[Agent]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{API_PORT}"}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    }))
    args = ["--kubeconfig", str(kubeconfig), "--event-namespace", "kube-system"]
    yield from run_agent(Agent(lab, tmp_path, tmp_path / "agent.log", source_args=args))


def test_rule_created_through_the_api_carries_traffic_and_its_deletion_stops_it(lab, fake_api, kube_agent):
    fake_api.create("iptables-eips", eip_doc())
    for name, ip in BACKENDS.items():
        fake_api.create("iptables-dnat-rules", rule_doc(f"web-{name}", 80, ip))
    kube_agent.wait_services(1)
    assert probe(lab, "/readyz") == (200, "ok") and probe(lab, "/livez") == (200, "ok")
    spread = lab.tcp_connect(EIP, 80, 30)
    assert spread["failed"] == 0 and all(spread["by_backend"][n] > 0 for n in BACKENDS), spread

    fake_api.delete("iptables-dnat-rules", "web-b3")
    wait_for(lambda: "10.0.1.13" not in kube_agent.nft("list", "table", "ip", "natgw"), what="b3 to go")
    assert lab.tcp_connect(EIP, 80, 30)["by_backend"]["b3"] == 0

    # The API goes away: nothing is removed, traffic keeps flowing; it comes back: converge.
    fake_api.set_down(True)
    fake_api.delete("iptables-dnat-rules", "web-b1")
    time.sleep(1.0)
    assert lab.tcp_connect(EIP, 80, 20)["failed"] == 0
    assert kube_agent.proc.poll() is None
    fake_api.set_down(False)
    wait_for(lambda: lab.tcp_connect(EIP, 80, 10)["by_backend"]["b2"] == 10, 10, what="convergence")

    fake_api.delete("iptables-dnat-rules", "web-b2")
    kube_agent.wait_services(0)
    assert lab.tcp_connect(EIP, 80, 3, timeout=0.5)["failed"] == 3
    assert any(r.verb == "watch" for r in fake_api.requests)


def test_a_backend_that_fails_its_checks_is_an_event_on_its_rule(lab, fake_api, kube_agent):
    """Issue 23: a transition is a Warning Event (BackendDown) on each rule behind the
    backend, and its return a Normal one (BackendUp)."""
    import subprocess
    import sys

    from gwtest import ROOT

    fake_api.create("iptables-eips", eip_doc())
    for name, ip in BACKENDS.items():
        fake_api.create("iptables-dnat-rules", rule_doc(f"web-{name}", 80, ip))
    fake_api.create("iptables-dnat-rules", rule_doc("web-late", 80, BACKENDS["b1"], 8087))  # nothing listens yet
    kube_agent.wait_services(1)

    def events(reason: str) -> list[dict]:
        return [e for e in fake_api.objects("events", namespace="kube-system") if e.get("reason") == reason]

    wait_for(lambda: events("BackendDown"), 6, 0.1, what="a BackendDown event")
    (down,) = events("BackendDown")
    assert down["involvedObject"]["name"] == "web-late" and down["type"] == "Warning", down
    assert f"{BACKENDS['b1']}:8087" in down["message"] and "refused" in down["message"], down
    assert lab.tcp_connect(EIP, 80, 20)["failed"] == 0
    server = lab.popen_in(lab.backend_ns[0], [sys.executable, "-m", "lab.traffic", "serve", "--name", "b1",
                                              "--tcp-port", "8087"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          cwd=ROOT)
    assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
    wait_for(lambda: events("BackendUp"), 6, 0.1, what="a BackendUp event")
    (up,) = events("BackendUp")
    assert up["involvedObject"]["name"] == "web-late" and up["type"] == "Normal", up
