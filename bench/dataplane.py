"""Data plane: the cost of a new connection through the gateway's NAT rules.

Per case a topology of three fresh namespaces:

    client 192.168.100.2 --veth-- 192.168.100.1 gateway 192.168.200.1 --veth-- 192.168.200.2 backend

The client routes 172.18.0.0/16 (the EIPs) via the gateway; the gateway forwards
(ip_forward=1) and routes 10.0.0.0/8 (the backend addresses) to the backend namespace,
which holds all of 10.0.0.0/8 as local (`ip route add local 10.0.0.0/8 dev lo`) and runs
one TCP server on 0.0.0.0:8080 answering with the address it was reached at. So every
identity's rules are real and every answer names the backend the gateway picked.

Gateways: the agent's table (through the agent's real code path, bench.sync_driver
--sync-only), stateless, ClientIP, or stateless with --masquerade (each connection also
SNATed to the gateway's eth0 address: what an HA gateway's replicas pay); and an iptables linear DNAT chain (the exclusive
path: one `-d EIP -p tcp --dport P -j DNAT --to-destination B` per identity), loaded with
iptables-legacy-restore and with iptables-nft-restore. The target is the identity whose
iptables rule is the last of the chain (the worst case). Runs are interleaved across
cases (run 1 of every case, then run 2, ...) so drift of the machine hits all alike."""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import identities as ids_mod
from bench.common import PYTHON, REPO, child_env, exec_in, namespaces, python_in

SERVER_PORT = ids_mod.BACKEND_PORT


@dataclass
class Case:
    kind: str  # "agent", "agent-clientip", "agent-masquerade" (stateless), "iptables-legacy", "iptables-nft"
    n: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> ids_mod.Identity:
        return ids_mod.identities(self.n, self.kind == "agent-clientip")[self.n - 1]

    def expected_answers(self) -> set[str]:
        t = self.target
        return {t.backends[0][0]} if self.kind.startswith("iptables") else {ip for ip, _ in t.backends}


class Topology:
    """The three namespaces of a case (made by lab/topology.py), wired as above."""

    def __init__(self) -> None:
        self.lab = namespaces("client", "gw", "b1")
        self.client, self.gateway, self.backend = (self.lab.names[r] for r in ("client", "gw", "b1"))
        self.uses_iptables_legacy = False

    def __enter__(self) -> "Topology":
        self.lab.start()
        try:
            self._wire()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.uses_iptables_legacy:  # only this namespace's: the legacy tables are not its nftables
            exec_in(self.gateway, ["iptables-legacy", "-t", "nat", "-F"], check=False)
        self.lab.close()

    def _wire(self) -> None:
        g, c, b = self.gateway, self.client, self.backend
        commands = {
            g: [f"link add net1 type veth peer name eth0 netns {c}", f"link add eth0 type veth peer name eth0 netns {b}",
                "addr add 192.168.100.1/24 dev net1", "addr add 192.168.200.1/24 dev eth0", "link set eth0 up",
                "link set net1 up", "route add 10.0.0.0/8 via 192.168.200.2"],
            c: ["addr add 192.168.100.2/24 dev eth0", "link set eth0 up", "route add 172.18.0.0/16 via 192.168.100.1"],
            b: ["addr add 192.168.200.2/24 dev eth0", "link set eth0 up", "route add default via 192.168.200.1",
                "route add local 10.0.0.0/8 dev lo"],
        }
        for ns, batch in commands.items():
            exec_in(ns, ["ip", "-batch", "-"], input="\n".join(batch) + "\n")
            exec_in(ns, ["sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0",
                         *(["net.ipv4.ip_forward=1"] if ns == g else [])])
        server = self.lab.popen_in(b, [PYTHON, "-m", "lab.traffic", "serve-addr", "--port", str(SERVER_PORT)],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, cwd=REPO, env=child_env())
        line = server.stdout.readline() if server.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"backend server did not start: {server.stderr.read() if server.stderr else ''}")


def _iptables_restore(idents: list[ids_mod.Identity]) -> str:
    lines = ["*nat", ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]", ":POSTROUTING ACCEPT [0:0]"]
    lines += [f"-A PREROUTING -d {x.eip}/32 -p {x.proto} -m {x.proto} --dport {x.port} -j DNAT --to-destination {x.backends[0][0]}:{x.backends[0][1]}"
              for x in idents]
    return "\n".join(lines + ["COMMIT", ""])


def program(case: Case, topo: Topology) -> None:
    """Load the case's ruleset into the gateway and check what the kernel holds."""
    g = topo.gateway
    if case.kind.startswith("agent"):
        affinity = case.kind == "agent-clientip"
        rules = Path(tempfile.mkdtemp(prefix="natgw-bench-dp-"))
        try:
            ids_mod.write_manifests(rules, ids_mod.identities(case.n, affinity))
            out = json.loads(python_in(g, "bench.sync_driver", ["--dir", str(rules), "--n", str(case.n), "--sync-only"]
                                      + (["--affinity"] if affinity else [])
                                      + (["--masquerade"] if case.kind == "agent-masquerade" else [])).stdout)
        finally:
            shutil.rmtree(rules, ignore_errors=True)
        case.setup = {"sync_s": out["sync_s"], "identities": out["kernel"]["identities"], "rules_or_backends": out["kernel"]["backends"]}
        return
    tool = case.kind  # iptables-legacy / iptables-nft
    topo.uses_iptables_legacy |= tool == "iptables-legacy"
    exec_in(g, [f"{tool}-restore"], input=_iptables_restore(ids_mod.identities(case.n, False)))
    listed = exec_in(g, [tool, "-t", "nat", "-S", "PREROUTING"]).stdout.splitlines()
    dnat = [line for line in listed if line.startswith("-A PREROUTING") and "-j DNAT" in line]
    last = ids_mod.identities(case.n, False)[-1]
    case.setup = {"identities": len(dnat), "rules_or_backends": len(dnat),
                  "target_is_last": bool(dnat) and f"--dport {last.port} " in dnat[-1] + " " and last.eip in dnat[-1]}


def measure_run(case: Case, topo: Topology, run: int, count: int, warmup: int) -> dict[str, Any]:
    t = case.target
    first = 10000 + run * (count + warmup)
    if first + count + warmup > 65000:
        raise ValueError("too many connections for distinct source ports")
    out = json.loads(python_in(topo.client, "lab.traffic", ["timed", "--dst", t.eip, "--port", str(t.port), "--count",
                                                            str(count), "--warmup", str(warmup), "--first-sport",
                                                            str(first)]).stdout)
    out["unexpected"] = sorted(set(out["answers"]) - case.expected_answers())
    return out


def summarize(case: Case) -> dict[str, Any]:
    """Median per-connection time per run; the median of those, their min and max, and the
    pooled IQR of all connections."""
    def stats(key: str) -> dict[str, float]:
        per_run = [statistics.median(r[key]) for r in case.runs if r[key]]
        pooled = sorted(x for r in case.runs for x in r[key])
        q = statistics.quantiles(pooled, n=4) if len(pooled) >= 4 else [float("nan")] * 3
        return {"median": statistics.median(per_run) if per_run else float("nan"),
                "run_min": min(per_run, default=float("nan")), "run_max": max(per_run, default=float("nan")),
                "q1": q[0], "q3": q[2]}
    answers: dict[str, int] = {}
    for r in case.runs:
        for who, k in r["answers"].items():
            answers[who] = answers.get(who, 0) + k
    return {
        "kind": case.kind, "n": case.n, "runs": len(case.runs),
        "connections": sum(len(r["connect"]) for r in case.runs),
        "errors": sum(r["error_count"] for r in case.runs),
        "error_samples": [e for r in case.runs for e in r["errors"]][:5],
        "unexpected": sorted({u for r in case.runs for u in r["unexpected"]}),
        "answers": answers, "expected": sorted(case.expected_answers()),
        "connect": stats("connect"), "total": stats("total"), "setup": case.setup,
    }


def run_all(kinds: list[str], sizes: list[int], runs: int, count: int, warmup: int, log: Any = print) -> list[dict[str, Any]]:
    cases = [Case(kind, n) for kind in kinds for n in sizes]
    topos: list[Topology] = []
    try:
        for case in cases:
            topo = Topology()
            topos.append(topo)
            topo.__enter__()
            program(case, topo)
            log(f"  data plane: {case.kind}, {case.n} identities programmed ({case.setup['identities']} in the kernel)")
        for run in range(runs):
            for case, topo in zip(cases, topos):
                case.runs.append(measure_run(case, topo, run, count, warmup))
            log(f"  data plane: run {run + 1}/{runs} done")
    finally:
        for topo in topos:
            topo.close()
    return [summarize(c) for c in cases]
