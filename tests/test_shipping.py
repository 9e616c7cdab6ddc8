"""What ships beside the code: the systemd unit and the Kubernetes manifests."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from agent.errors import ApplyError
from agent.report import Reporter
from tests.conftest import ROOT


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    # systemd-analyze checks every directive; point ExecStart at this checkout's agent.
    agent = Path(sys.executable).with_name("natgw-agent")
    unit = tmp_path / "natgw-agent.service"
    unit.write_text((ROOT / "systemd" / "natgw-agent.service").read_text()
                    .replace("/opt/natgw-agent/bin/natgw-agent", str(agent)))
    assert shutil.which("systemd-analyze"), "systemd-analyze missing: make deps installs the systemd package"
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    text = unit.read_text()
    assert "Restart=on-failure" in text and "CapabilityBoundingSet=CAP_NET_ADMIN" in text
    assert "Type=notify" in text and "WatchdogSec=" in text
    assert "--from-dir" in text


def test_statefulset_patch_probes_the_agents_endpoints() -> None:
    patch = yaml.safe_load((ROOT / "images" / "kubernetes" / "statefulset-patch.yaml").read_text())
    pod = patch["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "natgw-agent" and pod["automountServiceAccountToken"] is True
    (container,) = pod["containers"]
    assert container["name"] == "vpc-nat-gw"
    assert {e["name"] for e in container["env"]} >= {"GATEWAY_NAME", "POD_NAMESPACE", "POD_IP"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"  # never /healthz: a restart cuts every flow
    port = int(container["args"][container["args"].index("--metrics-addr") + 1].rsplit(":", 1)[1])
    assert port == container["readinessProbe"]["httpGet"]["port"] == container["livenessProbe"]["httpGet"]["port"]
    rbac = list(yaml.safe_load_all((ROOT / "images" / "kubernetes" / "rbac.yaml").read_text()))
    accounts = {(d["metadata"]["name"], d["metadata"]["namespace"]) for d in rbac if d["kind"] == "ServiceAccount"}
    assert ("natgw-agent", "kube-system") in accounts


class _Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, ...]] = []

    def warning(self, kind: str, name: str, uid: str, reason: str, message: str, api_version: str = "") -> None:
        self.sent.append((kind, name, reason, message))


def test_a_refused_transaction_gets_one_event_per_distinct_batch() -> None:
    sink = _Sink()
    reporter = Reporter(sink, "gw1")
    err = ApplyError(1, "Error: Could not process rule: File exists", "abc123abc123", 7)
    reporter.apply_failed(err)
    reporter.apply_failed(err)  # the retry of the same batch
    assert sink.sent == [("VpcNatGateway", "gw1", "ApplyFailed",
                          "nftables refused the transaction (digest abc123abc123, 7 commands): "
                          "Error: Could not process rule: File exists")]
    reporter.apply_succeeded()
    reporter.apply_failed(err)  # failing again after a success is news
    assert len(sink.sent) == 2
