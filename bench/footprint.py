"""Footprint and reaction on the Kubernetes path: `python -m bench.footprint [--baseline REF]
[--json FILE]` (root; network namespaces).

The agent as a process (`python -m agent.cli run`), configured as in a pod (the service
account's token and CA in --token-dir, KUBERNETES_SERVICE_HOST/PORT), the real
`kubernetes` client talking TLS to the fake API server (tests/kubefake) that listens in
the gateway namespace of a lab (lab/topology.py) and holds N identities x 4 rules
(bench/identities.py) with the metadata the API returns (uid, managedFields,
last-applied annotation: ~1.5 KB a rule). For each code version -- this tree, and with --baseline the commit REF, unpacked
aside and run the same way -- each mode (stateless, ClientIP) and each size:

  memory    resident (VmRSS) 2 s after the status socket says ready, and the peak
            (VmHWM) up to then; at 10,000 also the agent's own account (`show --memory`:
            glibc's heap in use and free)
At 10,000 stateless, on that agent:
  reaction  single watch events 30 ms apart (one rule's backend replaced each): the
            agent's `waited` per sync (from the source receiving the event to the kernel
            holding it, its log) and its histogram; bursts of 20 events at once: how many
            transactions each became
  traffic   new identities created through the API, each with a reachable backend, while
            a client (`lab.traffic reach`) connects in a loop: from the API write to the first
            connection answered
  idle      60 s with nothing happening: CPU (sum of the agent's threads' run time,
            /proc/PID/task/*/schedstat) as % of a core, and wake-ups per second
Plus one run at 10,000 stateless with PYTHONTRACEMALLOC=1: Python's objects by file.

Progress to stderr; one JSON document to stdout (and --json FILE). Targets are reported
against, never asserted."""
from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from pyroute2.netns import create_socket

from bench import common
from bench import identities as ids_mod
from bench.agent_driver import GATEWAY, Agent
from bench.common import PYTHON, REPO, child_env, machine
from lab.topology import Lab
from tests.kubefake import FakeKube

API_PORT = 16443
SIZES = (1000, 10000, 20000)
REACTION_N = 10000
EVENTS = 200
EVENT_GAP = 0.03
BURSTS, BURST = 10, 20
TRAFFIC = 40
TRAFFIC_EIP = "172.18.0.11"  # a lab EIP; the benchmark's identities there use ports 1000-1099
TRAFFIC_PORT = 20000
IDLE_SECONDS = 60.0
SETTLE = 2.0
TARGETS = {"rss_after_sync_mb": (100.0, "MB"), "rss_peak_mb": (200.0, "MB"), "waited_p50_ms": (5.0, "ms"),
           "waited_p99_ms": (20.0, "ms"), "idle_cpu_percent": (0.1, "% of a core")}


def log(msg: str) -> None:
    print(f"footprint: {msg}", file=sys.stderr, flush=True)


# --- objects as the API returns them ------------------------------------------------------------

def _dressed(obj: dict[str, Any]) -> dict[str, Any]:
    """What a real API server adds to an object applied with kubectl and updated by
    kube-ovn's controller: the agent must not pay for any of it."""
    meta = obj["metadata"]
    meta.pop("resourceVersion", None)
    applied = {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": {"name": meta["name"]},
               "spec": obj["spec"]}
    meta["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": json.dumps(applied) + "\n"}
    meta["creationTimestamp"] = "2026-11-30T09:12:44Z"
    meta["generation"] = 1
    meta["managedFields"] = [
        {"apiVersion": obj["apiVersion"], "fieldsType": "FieldsV1", "manager": "kubectl-client-side-apply",
         "operation": "Update", "time": "2026-11-30T09:12:44Z",
         "fieldsV1": {"f:metadata": {"f:annotations": {".": {}, "f:kubectl.kubernetes.io/last-applied-configuration": {}}},
                      "f:spec": {".": {}, **{f"f:{k}": {} for k in obj["spec"]}}}},
        {"apiVersion": obj["apiVersion"], "fieldsType": "FieldsV1", "manager": "kube-ovn-controller",
         "operation": "Update", "subresource": "status", "time": "2026-11-30T09:12:45Z",
         "fieldsV1": {"f:status": {".": {}, **{f"f:{k}": {} for k in obj.get("status", {})}}}},
    ]
    return obj


def objects(n: int, affinity: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(EIPs, rules) of N identities x 4."""
    with tempfile.TemporaryDirectory() as d:
        ids_mod.write_manifests(Path(d), ids_mod.identities(n, affinity))
        docs = [json.loads(p.read_text()) for p in sorted(Path(d).glob("*.json"))]
    items = [_dressed(o) for doc in docs for o in doc["items"]]
    return [o for o in items if o["kind"] == "IptablesEIP"], [o for o in items if o["kind"] == "IptablesDnatRule"]


# --- the agent under test ---------------------------------------------------------------------

def start_agent(world: World, code: Path, work: Path, env: dict[str, str] | None = None) -> Agent:
    """The agent of one code tree in the lab's gateway namespace, configured as in a pod,
    without health checks: nothing answers at the identities' backend addresses, and
    their checks (up to 5% of a core, budgeted; bench/checks.py measures them and their
    memory) would be what the idle and reaction figures measure."""
    return Agent(world.lab.gw_ns, ["--token-dir", str(world.token_dir), "--event-namespace", "kube-system"], work,
                 code=code, env={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(API_PORT),
                                 **(env or {})}, checks=False).start()


class World:
    """A lab, the fake API in its gateway namespace, and the objects in it."""

    def __init__(self, n: int, affinity: bool) -> None:
        self.lab = Lab(backends=1, prefix="nfp")
        self.lab.start()
        self._dir = tempfile.TemporaryDirectory(prefix="natgw-fp-api-")
        self.token_dir = Path(self._dir.name)
        try:
            sock = create_socket(self.lab.gw_ns, socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", API_PORT))
            sock.listen(64)
            self.fake = FakeKube(self._tls(sock))
            self.fake.__enter__()
            eips, self.rules = objects(n, affinity)
            self.eip_names = {o["metadata"]["name"] for o in eips}
            for o in eips:
                self.fake.create("iptables-eips", o)
            for o in self.rules:
                self.fake.create("iptables-dnat-rules", o)
            self.fake.compact()  # the history of loading them is not the agent's to hold
        except BaseException:
            self.lab.close()
            raise

    def _tls(self, sock: socket.socket) -> ssl.SSLSocket:
        """TLS, as the API speaks it to a pod: a certificate for 127.0.0.1, its CA (itself)
        and a token where the service account's would be."""
        cert, key = self.token_dir / "ca.crt", self.token_dir / "tls.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "1", "-subj", "/CN=fake-apiserver", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
        (self.token_dir / "token").write_text("fake-service-account-token")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(cert), str(key))
        return context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)

    def close(self) -> None:
        self.fake.__exit__(None, None, None)
        self.lab.close()
        self._dir.cleanup()


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _dist(xs: list[float]) -> dict[str, Any]:
    ms = [x * 1000 for x in xs]
    return {"n": len(ms), "p50_ms": _percentile(ms, 0.5), "p90_ms": _percentile(ms, 0.9),
            "p99_ms": _percentile(ms, 0.99), "max_ms": max(ms) if ms else None,
            "mean_ms": statistics.fmean(ms) if ms else None}


# --- the measurements -----------------------------------------------------------------------

def memory_run(code: Path, n: int, affinity: bool, detail: bool) -> tuple[dict[str, Any], World, Agent]:
    world = World(n, affinity)
    work = Path(tempfile.mkdtemp(prefix="natgw-fp-"))
    agent = start_agent(world, code, work)
    try:
        ready = agent.wait_ready()
        time.sleep(SETTLE)
        st = agent.status()
        out: dict[str, Any] = {"n": n, "affinity": affinity, "ready_s": round(ready, 2),
                               "rss_mb": round(st["VmRSS"] / 1024, 1), "peak_mb": round(st["VmHWM"] / 1024, 1)}
        if detail:
            out["agent_memory"] = agent.memory()
        log(f"  {n} x 4 {'ClientIP' if affinity else 'stateless'}: ready {ready:.1f} s, "
            f"resident {out['rss_mb']} MB, peak {out['peak_mb']} MB")
        return out, world, agent
    except BaseException:
        agent.stop()
        world.close()
        raise


class Counts(NamedTuple):
    """How much of each measurement: the full run's, or --quick's (a test that it works)."""

    events: int = EVENTS
    bursts: int = BURSTS
    traffic: int = TRAFFIC
    idle_seconds: float = IDLE_SECONDS


QUICK = Counts(events=20, bursts=2, traffic=5, idle_seconds=3.0)


def reaction(world: World, agent: Agent, counts: Counts = Counts()) -> dict[str, Any]:
    """Single events, then bursts: (the agent's waited per sync, transactions per burst)."""
    rules = world.rules
    before = len(agent.synced())
    for k in range(counts.events):
        rule = copy.deepcopy(rules[4 * k + 3])
        rule["spec"]["internalIp"] = f"10.2.{k // 250}.{k % 250 + 1}"
        world.fake.update("iptables-dnat-rules", rule)
        time.sleep(EVENT_GAP)
    time.sleep(1.0)
    singles = agent.synced()[before:]
    waited = [e["waited"] for e in singles if "waited" in e]
    per_burst = []
    for b in range(counts.bursts):
        mark = len(agent.synced())
        for k in range(BURST):
            i = counts.events + b * BURST + k
            rule = copy.deepcopy(rules[4 * i + 3])
            rule["spec"]["internalIp"] = f"10.3.{i // 250}.{i % 250 + 1}"
            world.fake.update("iptables-dnat-rules", rule)
        time.sleep(0.5)
        per_burst.append(len(agent.synced()) - mark)
    return {"events": counts.events, "syncs": len(singles), "waited": _dist(waited) if waited else None,
            "bursts": counts.bursts, "burst_size": BURST, "transactions_per_burst": per_burst,
            "histogram": _histogram(agent.metrics())}


def _histogram(text: str) -> dict[str, int]:
    """natgw_network_programming_duration_seconds's cumulative buckets (le -> count)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("natgw_network_programming_duration_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = int(float(line.rsplit(" ", 1)[1]))
    return out


def traffic(world: World, agent: Agent, count: int = TRAFFIC) -> dict[str, Any]:
    """From the API write of a new identity to its first connection answered."""
    backend = (world.lab.backend_ips[0], 8080)
    eip_name = "eip-" + TRAFFIC_EIP.replace(".", "-")
    if eip_name not in world.eip_names:
        world.fake.create("iptables-eips", _dressed({
            "apiVersion": "kubeovn.io/v1", "kind": "IptablesEIP", "metadata": {"name": eip_name},
            "spec": {"v4ip": TRAFFIC_EIP, "natGwDp": GATEWAY}, "status": {"ready": True, "ip": TRAFFIC_EIP}}))
        time.sleep(0.5)
    client = world.lab.popen_in(world.lab.client_ns, [PYTHON, "-m", "lab.traffic", "reach"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=REPO, env=child_env())
    assert client.stdin is not None and client.stdout is not None
    json.loads(client.stdout.readline())
    latencies, attempts = [], []
    for k in range(count):
        port = TRAFFIC_PORT + k
        client.stdin.write(f"{TRAFFIC_EIP} {port}\n")
        client.stdin.flush()
        time.sleep(0.03)  # the client is refused meanwhile: the port has no DNAT yet
        written = time.monotonic()
        world.fake.create("iptables-dnat-rules", _dressed({
            "apiVersion": "kubeovn.io/v1", "kind": "IptablesDnatRule", "metadata": {"name": f"reach-{k}"},
            "spec": {"eip": eip_name, "externalPort": str(port), "protocol": "tcp", "internalIp": backend[0],
                     "internalPort": str(backend[1]), "type": "share"}}))
        answer = json.loads(client.stdout.readline())
        if answer["at"] is not None:
            latencies.append(answer["at"] - written)
            attempts.append(answer["attempts"])
    client.stdin.close()
    client.wait(10)
    return {"identities": count, "reached": len(latencies), **_dist(latencies)}


def idle(agent: Agent, seconds: float = IDLE_SECONDS) -> dict[str, Any]:
    time.sleep(2.0)
    ns0, runs0 = agent.schedstat()
    t0 = time.monotonic()
    time.sleep(seconds)
    ns1, runs1 = agent.schedstat()
    wall = time.monotonic() - t0
    return {"seconds": round(wall, 1), "cpu_percent": round((ns1 - ns0) / 1e9 / wall * 100, 4),
            "wakeups_per_s": round((runs1 - runs0) / wall, 2)}


MEMPROBE = REPO / "bench" / "memprobe"


def traced(code: Path, n: int) -> dict[str, Any] | None:
    """Python's objects by file at n stateless (PYTHONTRACEMALLOC=1): from the agent's
    memory query, or, for code that has none, from bench/memprobe (SIGUSR1)."""
    world = World(n, False)
    work = Path(tempfile.mkdtemp(prefix="natgw-fp-"))
    probe = work / "memprobe.json"
    agent = start_agent(world, code, work, env={"PYTHONTRACEMALLOC": "1", "NATGW_MEMPROBE": str(probe),
                                                "PYTHONPATH": f"{code}{os.pathsep}{MEMPROBE}"})
    try:
        agent.wait_ready(600.0)
        time.sleep(SETTLE)
        found = agent.memory()
        if found is None or found.get("ok") is False:  # an older agent: no such query
            agent.proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 120.0
            while not probe.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            found = json.loads(probe.read_text()) if probe.exists() else None
        return found
    finally:
        agent.stop()
        world.close()


def version(code: Path, label: str, sizes: tuple[int, ...], detail: bool, reaction_at: int,
            counts: Counts) -> dict[str, Any]:
    log(f"{label} ({code})")
    out: dict[str, Any] = {"label": label, "memory": []}
    for affinity in (False, True):
        for n in sizes:
            res, world, agent = memory_run(code, n, affinity, n == reaction_at)
            try:
                out["memory"].append(res)
                if n == reaction_at and not affinity:
                    log("  reaction")
                    out["reaction"] = reaction(world, agent, counts)
                    log(f"    {out['reaction']['waited']}, bursts -> {out['reaction']['transactions_per_burst']}")
                    log("  traffic")
                    out["traffic"] = traffic(world, agent, counts.traffic)
                    log(f"    {out['traffic']}")
                    log(f"  idle ({counts.idle_seconds:.0f} s)")
                    out["idle"] = idle(agent, counts.idle_seconds)
                    log(f"    {out['idle']}")
            finally:
                agent.stop()
                world.close()
    if detail:
        log("  traced (PYTHONTRACEMALLOC=1)")
        out["traced"] = traced(code, reaction_at)
    return out


def run(sizes: tuple[int, ...], baseline: str | None, reaction_at: int = REACTION_N,
        counts: Counts = Counts(), trace: bool = True) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": machine(), "sizes": list(sizes), "targets": TARGETS, "versions": []}
    for tree, label, _ in common.versions(baseline):
        result["versions"].append(version(tree, label, sizes, trace, reaction_at, counts))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="identities per run, comma-separated")
    ap.add_argument("--baseline", help="also measure this commit (e.g. a05ea73), side by side")
    ap.add_argument("--reaction-at", type=int, default=REACTION_N,
                    help="the size whose stateless agent is also measured for reaction, traffic and idle")
    ap.add_argument("--idle-seconds", type=float, help=f"how long to measure the idle agent (default {IDLE_SECONDS:g})")
    ap.add_argument("--no-trace", action="store_true", help="skip the PYTHONTRACEMALLOC run")
    ap.add_argument("--quick", action="store_true",
                    help="few events, bursts and identities reached, a short idle: a test that it all works")
    ap.add_argument("--json", type=Path, help="write the result here too")
    args = ap.parse_args(argv)
    counts = QUICK if args.quick else Counts()
    if args.idle_seconds is not None:
        counts = counts._replace(idle_seconds=args.idle_seconds)
    result = run(tuple(int(s) for s in args.sizes.split(",")), args.baseline, args.reaction_at, counts,
                 not args.no_trace)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
