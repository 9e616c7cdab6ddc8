"""Helpers for the network-namespace tests: the agent as a process in the gateway
namespace, manifests, waiting, statistics. (Not in conftest.py: tests/ has a conftest of
its own, and two modules named conftest cannot both be imported by name.)"""
from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from agent.core.layout import SERVICES, affinity_set, backend_map, pattern_chain, slot_chain, sticky_chain
from agent.settings import Settings
from lab.topology import Lab

ROOT = Path(__file__).resolve().parent.parent
GATEWAY = "gw1"
TABLE = Settings.table
EIP = "172.18.0.10"
OTHER_EIP = "172.18.0.11"
BACKENDS = {"b1": "10.0.1.11", "b2": "10.0.1.12", "b3": "10.0.1.13"}


def log_entries(path: Path) -> list[dict[str, Any]]:
    """An agent's JSON log lines, parsed (anything else in the file left out)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


@contextlib.contextmanager
def fresh_namespace(prefix: str) -> Iterator[str]:
    """A network namespace as `ip netns add` makes it (lo down), always deleted."""
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def script_in_fresh_namespace(prefix: str, script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """netns-tests/scripts/<script> run in a network namespace of its own (always deleted)."""
    with fresh_namespace(prefix) as ns:
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, f"netns-tests/scripts/{script}", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def ns_run(ns: str, *argv: str, stdin: str | None = None, timeout: float = 120) -> str:
    """A command in a namespace, from the repository's root; its output, once it exited 0."""
    done = subprocess.run(["ip", "netns", "exec", ns, *argv], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, f"{argv[:4]}: rc={done.returncode} {done.stderr[-2000:]}"
    return done.stdout


def report_of(done: subprocess.CompletedProcess[str]) -> Any:
    """A script's last line of output, as JSON, once it exited 0."""
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    """natgw-agent running as its own process inside the gateway namespace (the lab's, or
    `ns`: one of several gateway replicas the lab holds, as in test_replicas.py)."""

    def __init__(self, lab: Lab, rules_dir: Path, log_path: Path, source_args: list[str] | None = None,
                 supervised: bool = False, ns: str | None = None) -> None:
        self.lab = lab
        self.ns = ns or lab.gw_ns
        self.supervised = supervised  # under the supervisor (`natgw-supervise`), as in its container
        self.rules_dir = rules_dir
        self.log_path = log_path
        self.source_args = source_args or ["--from-dir", str(rules_dir)]
        self.state_dir = log_path.parent / f"{log_path.stem}.state"  # its status socket: one per agent
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        run = ["--log-format", "json", "run", "--gateway", GATEWAY, "--state-dir", str(self.state_dir), *self.source_args]
        # Supervised: through the supervisor's own entry point, as the container's command runs it.
        argv = [sys.executable, "-m", *(["agent.deploy.supervise", *run] if self.supervised else ["agent.cli", *run])]
        self._log = open(self.log_path, "ab")
        self.proc = self.lab.popen_in(self.ns, argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        self._log.close()
        return rc

    def logs(self) -> list[dict[str, Any]]:
        return log_entries(self.log_path)

    def nft(self, *args: str) -> str:
        return self.lab.run_in(self.ns, ["nft", *args], capture_output=True, text=True, check=True).stdout

    def nft_transaction(self, commands: list[list[str]]) -> None:
        """Several nft commands as one transaction (`nft -f -`): the agent repairs drift
        within milliseconds, so damage done in separate commands is repaired between
        them (and a later step, deleting a set the repair refilled a chain with, fails)."""
        self.lab.run_in(self.ns, ["nft", "-f", "-"], input="\n".join(" ".join(c) for c in commands) + "\n",
                        capture_output=True, text=True, check=True)

    def services(self) -> dict[tuple[Any, ...], str]:
        """The kernel's services map: identity key -> target chain."""
        out = self.lab.run_in(self.ns, ["nft", "-j", "list", "map", "ip", TABLE, SERVICES],
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


# Damage someone else may do to the agent's table, as nft commands.
T = ["ip", TABLE]
DRIFTS = {
    "table deleted": [["delete", "table", *T]],
    "chain flushed": [["flush", "chain", *T, slot_chain(0)]],
    "map element deleted": [["delete", "element", *T, backend_map(1), f"{{ {EIP} . tcp . 80 }}"]],
    "backend map deleted": [["flush", "chain", *T, slot_chain(1)], ["delete", "map", *T, backend_map(1)]],
    "backend map redeclared": [  # only nft text declares it: emptied of users, deleted, declared anew
        ["flush", "chain", *T, slot_chain(1)], ["delete", "map", *T, backend_map(1)],
        ["add", "map", *T, backend_map(1), "{ type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service; }"]],
    "affinity set deleted": [["flush", "chain", *T, pattern_chain((0, 1, 2), 600)],
                             ["flush", "chain", *T, sticky_chain(0, 600)],
                             ["delete", "set", *T, affinity_set(0)]],
}


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


def kernel_table(lab: Lab, entries: bool = False) -> dict[str, Any] | None:
    """The agent's table read over the agent's own netlink view, in the gateway namespace
    (a libnftables listing, `nft list ...` included, never returns while another table
    commits every 100 ms: measured here). `static`: everything but the affinity
    entries, canonical; `entries`: set -> sorted keys."""
    code = ("import json, sys\nfrom agent.kernel.view import KernelView\n"
            "v = KernelView('ip', sys.argv[1], subscribe=False)\nst = v.read_state()\nrs = st and st.ruleset()\n"
            "print(json.dumps(None if rs is None else {\n"
            " 'identities': len(rs.elements.get('services', {})),\n"
            " 'static': repr((sorted(rs.sets.items()), sorted(rs.chains.items()), sorted(rs.rules.items()),\n"
            "                 sorted((n, sorted(e.items())) for n, e in rs.elements.items()))),\n"
            " 'entries': {n: sorted(repr(k) for k, _ in e) for n, e in st.entries.items()}}))\n")
    out = lab.run_in(lab.gw_ns, [sys.executable, "-c", code, TABLE], capture_output=True, text=True, cwd=ROOT,
                     timeout=60, check=True).stdout
    return json.loads(out)


def agent_status(agent: Agent, what: str = "status") -> dict[str, Any] | None:
    """What the running agent says on its status socket (None: nobody answers)."""
    code = ("import json, sys\nfrom pathlib import Path\nfrom agent.ops.status import query\n"
            "try:\n print(json.dumps(query(Path(sys.argv[1]), sys.argv[2])))\nexcept OSError:\n print('null')\n")
    out = agent.lab.run_in(agent.ns, [sys.executable, "-c", code, str(agent.state_dir / "agent.sock"), what],
                           capture_output=True, text=True, cwd=ROOT, timeout=10, check=True).stdout
    return json.loads(out)


class Neighbour:
    """lab.neighbour in the gateway namespace: another table committing every `interval`
    seconds for as long as the context lasts."""

    def __init__(self, lab: Lab, interval: float = 0.1) -> None:
        self.lab = lab
        self.interval = interval
        self.result: dict[str, Any] = {}

    def __enter__(self) -> Neighbour:
        self.proc = self.lab.popen_in(self.lab.gw_ns, [sys.executable, "-m", "lab.neighbour", "--interval",
                                                       str(self.interval)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *_: Any) -> None:
        out, _ = self.proc.communicate(timeout=10)  # closes stdin: it ends
        self.result = json.loads(out.strip().splitlines()[-1])


def reply_destinations(lab: Lab, proto: str, client: str | None, port: int) -> set[str]:
    """Where the backends' answers of flows to EIP:port go (from the client, or from any
    client: None), as the gateway's conntrack holds them: the EIP or the gateway's own
    address when the flow was SNATed, the client's address when it was not."""
    source = ["--orig-src", client] if client else []
    out = lab.run_in(lab.gw_ns, ["conntrack", "-L", "-p", proto, *source, "--orig-dst", EIP, "--dport", str(port)],
                     check=True).stdout
    return {re.findall(r"dst=(\S+)", line)[1] for line in out.splitlines() if "dst=" in line}
