"""Benchmark harness: `python -m bench.run [--quick] [--out DIR]` (root; network namespaces).

Full mode (about 10 minutes on 2 cores) writes BENCHMARKS.md and benchmarks-sync.png to
the repository root (or --out DIR); quick mode (well under a minute, small sizes) writes
them to a temporary directory unless --out is given, and is what bench/test_quick.py
runs and checks.

Approaches, on the same identities (bench/identities.py, 4 backends each):
  legacy      one `nft -f -` process per identity (bench/legacy.py)
  kube-proxy  one `nft -f` batch, per-identity chains and inline maps (bench/kubeproxy.py)
  agent       DirectorySource + Reconciler.sync through the agent's code (bench/sync_driver.py)
plus the data plane against an iptables linear chain (bench/dataplane.py), and the consistent
choice of a backend against a model of IPVS's `mh` (bench/choice.py: pure computation)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import choice, common, dataplane, report, sync
from bench.common import machine
from bench.report import fmt_s


@dataclass(frozen=True)
class Config:
    mode: str
    sizes: tuple[int, ...]
    legacy_max: int  # legacy is measured up to here; larger sizes are extrapolated
    change_sizes: tuple[int, ...]  # identities present for the one-change cases
    legacy_clientip_change_max: int  # loading a ClientIP table the legacy way is slow
    dp_kinds: tuple[str, ...]
    dp_sizes: tuple[int, ...]
    dp_runs: int
    dp_connections: int
    dp_warmup: int
    retire_delay: float = 1.0
    agent_retry_wait: float = 60.0
    settle_max: float = 20.0  # before each timed case, wait up to this long for a quiet machine
    choice: choice.Config = choice.FULL  # backend sets and clients of the consistent choice's comparison


FULL = Config(mode="full", sizes=(100, 1000, 10000), legacy_max=1000, change_sizes=(100, 10000),
              legacy_clientip_change_max=1000,
              dp_kinds=("agent", "agent-clientip", "agent-masquerade", "iptables-legacy", "iptables-nft"), dp_sizes=(10, 10000),
              dp_runs=5, dp_connections=2000, dp_warmup=50)
QUICK = Config(mode="quick", sizes=(10, 100), legacy_max=100, change_sizes=(10, 100), legacy_clientip_change_max=100,
               dp_kinds=("agent", "agent-clientip", "agent-masquerade", "iptables-legacy", "iptables-nft"), dp_sizes=(10, 1000),
               dp_runs=3, dp_connections=300, dp_warmup=20, retire_delay=0.2, agent_retry_wait=20.0,
               settle_max=2.0, choice=choice.QUICK)


def run(cfg: Config, log: Any = print) -> dict[str, Any]:
    start = time.perf_counter()
    results: dict[str, Any] = {"config": asdict(cfg), "machine": machine(), "legacy": [], "legacy_extrapolated": [],
                               "kubeproxy": [], "agent": [], "changes": [], "dataplane": [],
                               "loadavg_start": os.getloadavg()[0]}
    for affinity in (False, True):
        label = "ClientIP" if affinity else "stateless"
        measured_legacy: dict[str, Any] | None = None
        for n in cfg.sizes:
            if n <= cfg.legacy_max:
                log(f"legacy {label} {n} identities ({n} nft processes)")
                common.settle(cfg.settle_max)
                r = sync.legacy_full(n, affinity, do_change=n in cfg.change_sizes
                                     or (affinity and n == cfg.legacy_clientip_change_max))
                results["legacy"].append(r)
                measured_legacy = r
                log(f"  {fmt_s(r['seconds'])}, check {r['check']['ok']}")
            elif measured_legacy is not None:
                results["legacy_extrapolated"].append(sync.legacy_extrapolate(measured_legacy, n))
            log(f"kube-proxy {label} {n} identities (one batch)")
            common.settle(cfg.settle_max)
            r = sync.kubeproxy_case(n, affinity, do_change=n in cfg.change_sizes, retire_delay=cfg.retire_delay)
            results["kubeproxy"].append(r)
            log(f"  {fmt_s(r['seconds'])}, check {r['check']['ok']}")
            log(f"agent {label} {n} identities")
            common.settle(cfg.settle_max)
            r = sync.agent_case(n, affinity, retry_wait=cfg.agent_retry_wait, log=log)
            results["agent"].append(r)
            if "error" in r:
                log(f"  agent failed: {r['error'].splitlines()[0]}")
            else:
                log(f"  sync {fmt_s(r['sync_s'])}, check {r['check']['ok']}")
        for n in cfg.change_sizes:
            if n > cfg.legacy_max and (not affinity or n <= cfg.legacy_clientip_change_max):
                log(f"legacy {label}: one change with {n} present (table loaded in one batch first)")
                common.settle(cfg.settle_max)
                r = sync.legacy_change_at(n, affinity)
                results["changes"].append(r)
                log(f"  {fmt_s(r['seconds'])}, check {r['check']['ok']}")
    n = max(cfg.sizes)  # the price of the consistent choice: ClientIP with the first choice at random
    log(f"agent ClientIP {n} identities, --no-consistent-choice")
    common.settle(cfg.settle_max)
    results["agent_random"] = [sync.agent_case(n, True, retry_wait=cfg.agent_retry_wait, log=log, consistent=False)]
    log(f"data plane: {', '.join(cfg.dp_kinds)} at {cfg.dp_sizes} identities, {cfg.dp_runs} runs x {cfg.dp_connections} connections")
    results["dataplane"] = dataplane.run_all(list(cfg.dp_kinds), list(cfg.dp_sizes), cfg.dp_runs, cfg.dp_connections,
                                             cfg.dp_warmup, log=log)
    results["choice"] = choice.run(cfg.choice, log=log)
    results["runtime_s"] = time.perf_counter() - start
    results["loadavg_end"] = os.getloadavg()[0]
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, under a minute; output to a temp dir unless --out")
    p.add_argument("--out", type=Path, help="directory for BENCHMARKS.md and benchmarks-sync.png")
    p.add_argument("--json", type=Path, help="also write the raw results to this file")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("must run as root (it creates network namespaces)")
    cfg = QUICK if args.quick else FULL
    out = args.out or (Path(tempfile.mkdtemp(prefix="natgw-bench-")) if args.quick else common.REPO)
    out.mkdir(parents=True, exist_ok=True)
    common.install_signal_handlers()
    stale = common.cleanup_stale()
    if stale:
        print(f"removed namespaces of an earlier, killed run: {', '.join(stale)}")
    results = run(cfg)
    files = report.write(results, out)
    results["files"] = {k: str(v) for k, v in files.items()}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    print(f"done in {results['runtime_s']:.0f} s: {', '.join(str(f) for f in files.values())}")
    return results


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; namespaces removed", file=sys.stderr)
        sys.exit(130)
