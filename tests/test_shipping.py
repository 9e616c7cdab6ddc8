"""What ships beside the code: the systemd unit, the Kubernetes manifests, the wheel and the image."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.builders import ROOT


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


def test_the_injector_manifests_hang_together() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d
            for d in yaml.safe_load_all((ROOT / "images" / "kubernetes" / "injector.yaml").read_text())}
    (hook,) = docs[("MutatingWebhookConfiguration", "natgw-injector")]["webhooks"]
    from agent.deploy.inject import GATEWAY_LABEL, SERVICE_ACCOUNT

    assert hook["objectSelector"] == {"matchLabels": {GATEWAY_LABEL: "true"}}  # every gateway pod, both forms
    assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None"  # never keeps a gateway down
    assert hook["rules"] == [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    service = docs[("Service", "natgw-injector")]
    assert hook["clientConfig"]["service"] == {"name": "natgw-injector", "namespace": "kube-system", "path": "/mutate",
                                               "port": service["spec"]["ports"][0]["port"]}
    deploy = docs[("Deployment", "natgw-injector")]["spec"]["template"]
    assert service["spec"]["selector"] == deploy["metadata"]["labels"]
    (container,) = deploy["spec"]["containers"]
    command = container["command"]
    assert command[:1] == ["natgw-agent"] and "inject" in command
    assert command[command.index("--listen") + 1] == f":{container['ports'][0]['containerPort']}"
    (mount,) = container["volumeMounts"]
    assert command[command.index("--tls-cert") + 1] == f"{mount['mountPath']}/tls.crt"
    (volume,) = deploy["spec"]["volumes"]
    assert volume["secret"]["secretName"] == docs[("Certificate", "natgw-injector")]["spec"]["secretName"]
    assert {e["name"]: e["value"] for e in container["env"]}["NATGW_AGENT_IMAGE"] == container["image"]
    assert container["securityContext"]["runAsNonRoot"] is True  # the injector needs no privilege
    rbac = list(yaml.safe_load_all((ROOT / "images" / "kubernetes" / "rbac.yaml").read_text()))
    accounts = {(d["metadata"]["name"], d["metadata"]["namespace"]) for d in rbac if d["kind"] == "ServiceAccount"}
    assert (SERVICE_ACCOUNT, "kube-system") in accounts


def test_the_wheel_holds_the_agent_only(tmp_path: Path) -> None:
    """Built from a copy of the whole repository (so a packaging setting that picked up
    lab/, tests/ or bench/ would show): nothing but agent/ and the metadata."""
    import shutil
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", ".hypothesis",
                                                             "__pycache__", ".pytest_cache"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"agent", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "agent/cli.py" in names and not any("lab" in n.split("/")[0] for n in names)
