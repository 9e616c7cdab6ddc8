"""Helpers for the network-namespace tests: the agent as a process in the gateway
namespace, manifests, waiting, statistics. (Not in conftest.py: tests/ has a conftest of
its own, and two modules named conftest cannot both be imported by name.)"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from agent.layout import SERVICES
from agent.settings import Settings
from lab.topology import Lab

ROOT = Path(__file__).resolve().parent.parent
GATEWAY = "gw1"
TABLE = Settings.table
EIP = "172.18.0.10"
OTHER_EIP = "172.18.0.11"
BACKENDS = {"b1": "10.0.1.11", "b2": "10.0.1.12", "b3": "10.0.1.13"}


def wait_for(check: Callable[[], Any], timeout: float = 5.0, interval: float = 0.05, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Agent:
    """natgw-agent running as its own process inside the gateway namespace."""

    def __init__(self, lab: Lab, rules_dir: Path, log_path: Path, source_args: list[str] | None = None) -> None:
        self.lab = lab
        self.rules_dir = rules_dir
        self.log_path = log_path
        self.source_args = source_args or ["--from-dir", str(rules_dir)]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "agent.cli", "--log-format", "json", "run", "--gateway", GATEWAY,
                *self.source_args]
        self._log = open(self.log_path, "ab")
        self.proc = self.lab.popen_in(self.lab.gw_ns, argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        self._log.close()
        return rc

    def logs(self) -> list[dict[str, Any]]:
        lines = self.log_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def nft(self, *args: str) -> str:
        return self.lab.run_in(self.lab.gw_ns, ["nft", *args], capture_output=True, text=True, check=True).stdout

    def services(self) -> dict[tuple[Any, ...], str]:
        """The kernel's services map: identity key -> target chain."""
        out = self.lab.run_in(self.lab.gw_ns, ["nft", "-j", "list", "map", "ip", TABLE, SERVICES],
                              capture_output=True, text=True)
        if out.returncode != 0:
            return {}
        result = {}
        for item in json.loads(out.stdout)["nftables"]:
            for key, value in item.get("map", {}).get("elem", []):
                if "elem" in key:
                    key = key["elem"]["val"]
                result[tuple(key["concat"])] = value["goto"]["target"] if "goto" in value else json.dumps(value)
        return result

    def wait_services(self, count: int, timeout: float = 5.0) -> dict[tuple[Any, ...], str]:
        seen: list[dict[tuple[Any, ...], str]] = []

        def ready() -> bool:
            seen[:] = [self.services()]
            return len(seen[0]) == count

        wait_for(ready, timeout, what=f"{count} identities in the kernel")
        return seen[0]


def write_rules(directory: Path, name: str, text: str) -> None:
    """Replace a rules file atomically, as an operator's tooling would."""
    tmp = directory / f".{name}.tmp"
    tmp.write_text(text)
    tmp.replace(directory / name)


def run_agent(running: Agent) -> Iterator[Agent]:
    running.start()
    yield running
    if running.proc is not None and running.proc.poll() is None:
        running.stop(signal.SIGKILL)
    sys.stderr.write(running.log_path.read_text()[-4000:])


def eip_doc(name: str = "eip-web", address: str = EIP, gateway: str = GATEWAY) -> dict[str, Any]:
    return {"apiVersion": "kubeovn.io/v1", "kind": "IptablesEIP", "metadata": {"name": name},
            "spec": {"v4ip": address, "natGwDp": gateway}, "status": {"ready": True, "ip": address}}


def rule_doc(name: str, port: int, backend: str, backend_port: int = 8080, proto: str = "tcp",
             eip: str = "eip-web", affinity: str = "", timeout: int = 0) -> dict[str, Any]:
    return {"apiVersion": "kubeovn.io/v1", "kind": "IptablesDnatRule", "metadata": {"name": name},
            "spec": {"eip": eip, "externalPort": str(port), "protocol": proto, "internalIp": backend,
                     "internalPort": str(backend_port), "type": "share", "sessionAffinity": affinity,
                     "sessionAffinityTimeoutSeconds": timeout}}


def yaml_docs(*docs: dict[str, Any]) -> str:
    import yaml

    return "---\n".join(yaml.safe_dump(d) for d in docs)


def chi_square(counts: list[int]) -> float:
    expected = sum(counts) / len(counts)
    return sum((c - expected) ** 2 / expected for c in counts)


# Chi-square critical value for 2 degrees of freedom at p = 0.00001: a fair spread over
# three backends fails this once in 100,000 runs (p = 0.001 failed once in ~20 CI runs
# here, as it should once in 1,000), while a real bias (a backend never chosen, or
# 50/25/25 over 600 connections: chi-square 75) is far above it.
CHI2_CRITICAL_DF2 = 23.03


WEB = [rule_doc(f"web-{n}", 80, ip) for n, ip in BACKENDS.items()]
DNS = [rule_doc(f"dns-{n}", 53, ip, 5353, proto="UDP") for n, ip in BACKENDS.items()]
APP = [rule_doc(f"app-{n}", 443, ip, 9090, affinity="ClientIP", timeout=600) for n, ip in BACKENDS.items()]
CLIENTS = [f"172.18.0.{i}" for i in range(101, 121)]


def program(agent: Agent, *docs: dict[str, Any], identities: int) -> None:
    """Replace the agent's rules with these (and the EIP) and wait until the kernel has them."""
    write_rules(agent.rules_dir, "rules.yaml", yaml_docs(eip_doc(), *docs))
    agent.wait_services(identities)


def http_get(lab: Lab, path: str) -> tuple[int, str]:
    """GET the agent's http endpoint from inside the gateway namespace, as the kubelet or
    Prometheus would."""
    code = ("import urllib.request, urllib.error\n"
            f"try:\n r = urllib.request.urlopen('http://127.0.0.1:10299{path}', timeout=5)\n"
            " print(r.status); print(r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n print(e.code); print(e.read().decode())\n")
    out = lab.run_in(lab.gw_ns, [sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    status, _, body = out.partition("\n")
    return int(status), body


def probe(lab: Lab, path: str) -> tuple[int, str]:
    """A health endpoint's status code and JSON status word."""
    status, body = http_get(lab, path)
    return status, json.loads(body)["status"]
