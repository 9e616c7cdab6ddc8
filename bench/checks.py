"""The health checks' cost at scale (issue 23): `python -m bench.checks [--quick] [--json FILE]`
(root; network namespaces).

The agent as a process (bench/agent_driver.py, `run --from-dir`) on N identities x 4
backends (bench/identities.py: 4N distinct addresses 10.1.x.y:8080), in a fresh namespace
where every backend answers: 10.1.0.0/16 and 10.2.0.0/16 are local (on lo) and a listener
on 0.0.0.0:8080 (a process of its own, backlog 4096) accepts and closes. Each case, once
the first full sync is done and the stretch holds still (three status answers within 10%,
after every target was checked once on average):

  cpu       the agent's utime+stime (/proc/PID/stat) over a window, as % of one core
  checks    checks done in the window (the targets' `checks` in the status socket's answer,
            as `show --json` gives it), against targets / (interval x stretch)
  sync      one rules file rewritten mid-window (one identity's backend replaced): from the
            write to the agent's `synced` log line, and that line's `seconds` and `waited`
  show      `natgw-agent show --json` after the window: its exit code and time
  memory    the agent's resident memory (VmRSS) at the end of the window, and its peak (VmHWM)

Cases: N with --no-health-checks (the idle baseline, the same change included), N with
the defaults (interval 1 s, budget 5% of a core), 100 identities with the defaults (no
stretch needed), and in full mode N with each identity's 4th backend refusing (TCP reset):
N targets down (once they all are), no identity failing open.
Progress to stderr, one JSON document to stdout (and --json FILE); nothing is asserted."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from agent.ops.status import query
from bench import common
from bench import identities as ids_mod
from bench.agent_driver import Agent
from bench.common import PYTHON, REPO, child_env, cpu_times, end, in_ns, machine

CLK_TCK = os.sysconf("SC_CLK_TCK")
STRETCHED = "health checks stretched to keep their CPU budget"
REFUSED = "the 4th backend of each identity refused (TCP reset)"
LISTENER = """import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(4096); print("listening", flush=True)
while True:
    s.accept()[0].close()
"""


class Config(NamedTuple):
    n: int = 10000
    window: float = 60.0  # seconds of CPU measured per case: more than a round of checks at 10,000 x 4 (~40 s)
    small: int = 100  # the case where the 1 s interval should hold
    refused: bool = True  # the case with a quarter of the backends refusing
    # Seconds to wait for the stretch to hold still, and in the refused case for every refused
    # target to be down: its first check waits up to one stretched interval (x24-x70 here, a
    # refused check costing ~60 us: the reject rule's work is charged to the agent's process
    # on loopback), then the paced re-checks of 10,000 at once: 58-114 s in runs here, 300 s
    # leaves room for a slower machine.
    settle_max: float = 300.0
    poll: float = 3.0  # seconds between status answers while settling (each costs the agent CPU)


FULL = Config()
QUICK = Config(n=1000, window=10.0, refused=False, settle_max=10.0, poll=1.0)


def log(msg: str) -> None:
    print(f"checks: {msg}", file=sys.stderr, flush=True)


@contextmanager
def world(n: int, refuse: bool) -> Iterator[tuple[str, Path, list[ids_mod.Identity], int]]:
    """A namespace where every backend answers (or each identity's 4th refuses), n identities' rules
    in a directory: (namespace, directory, identities, the listener's pid)."""
    idents = ids_mod.identities(n, False)
    with common.namespace() as ns, tempfile.TemporaryDirectory(prefix="natgw-checks-") as d:
        rules = Path(d) / "rules"
        ids_mod.write_manifests(rules, idents)
        for prefix in ("10.1.0.0/16", "10.2.0.0/16"):
            common.exec_in(ns, ["ip", "route", "add", "local", prefix, "dev", "lo"])
        if refuse:  # a quarter of the backends down, none of the identities failing open
            refused = ", ".join(x.backends[-1][0] for x in idents)
            common.exec_in(ns, ["nft", "-f", "-"], input=(
                f"table inet bench {{ set refused {{ type ipv4_addr; elements = {{ {refused} }}; }}; chain input {{ "
                f"type filter hook input priority 0; ip daddr @refused tcp dport {ids_mod.BACKEND_PORT} "
                "reject with tcp reset; }; }"))
        listener = subprocess.Popen(in_ns(ns, [PYTHON, "-c", LISTENER, str(ids_mod.BACKEND_PORT)]),
                                    stdout=subprocess.PIPE, text=True)
        try:
            if listener.stdout is None or listener.stdout.readline().strip() != "listening":
                raise RuntimeError(f"the listener did not start (rc {listener.poll()})")
            yield ns, rules, idents, listener.pid
        finally:
            end(listener)


def health(agent: Agent) -> dict[str, Any]:
    """The health part of the agent's status (what `show --json` shows as agent.health), summed;
    `by`: each target's checks so far."""
    t = time.perf_counter()
    h = query(agent.state / "agent.sock", "status", timeout=60.0).get("health") or {}
    rows = h.get("targets", [])
    by = {(r["backend"], r["check"]): r["checks"] for r in rows}
    return {"at": t, "asked_s": time.perf_counter() - t, "stretch": h.get("stretch", 1.0), "targets": len(rows),
            "checks": sum(by.values()), "by": by, "down": sum(1 for r in rows if not r["up"]),
            "fail_open": len(h.get("failOpen", []))}


def settle(agent: Agent, cfg: Config, down: int) -> dict[str, Any]:
    """Wait until the stretch holds still (three answers within 10%) after a round of checks,
    and `down` targets are down."""
    t0, seen, downs = time.perf_counter(), [], []
    while time.perf_counter() - t0 < cfg.settle_max:
        h = health(agent)
        seen.append(round(h["stretch"], 2))
        downs.append(h["down"])
        last = seen[-3:]
        if len(last) == 3 and h["checks"] >= h["targets"] and max(last) <= 1.1 * min(last) and h["down"] >= down:
            break
        time.sleep(cfg.poll)
    else:
        return {"settled": False, "seconds": round(time.perf_counter() - t0, 1), "stretches": seen, "downs": downs}
    return {"settled": True, "seconds": round(time.perf_counter() - t0, 1), "stretches": seen, "downs": downs}


def change(agent: Agent, rules: Path, idents: list[ids_mod.Identity]) -> dict[str, Any]:
    """One identity's last backend replaced (its rules file rewritten): until the agent logs
    the sync that took it (at most 30 s)."""
    before = len(agent.synced())
    k = len(idents) // 2
    changed = [*idents[:k], ids_mod.changed(idents[k]), *idents[k + 1:]]
    t0 = time.perf_counter()
    ids_mod.write_rules_chunk(rules, changed, k // ids_mod.RULES_PER_FILE_IDENTITIES)
    while time.perf_counter() - t0 < 30.0:
        if len(synced := agent.synced()) > before:
            s = synced[before]
            return {"logged_s": time.perf_counter() - t0, "seconds": s.get("seconds"), "waited": s.get("waited"),
                    "commands": s.get("commands")}
        time.sleep(0.01)
    return {"logged_s": None}


def ticks(pid: int, tid: int | None = None) -> int:
    """utime + stime of a process, all its threads (or of its thread `tid`)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat").read_text()
    f = stat[stat.rindex(")") + 2:].split()
    return int(f[11]) + int(f[12])


def measure(agent: Agent, listener: int, cfg: Config, rules: Path, idents: list[ids_mod.Identity],
            checks: bool) -> dict[str, Any]:
    """The agent's CPU over the window, a change in its middle; checks done, from the status."""
    assert agent.proc is not None
    h0 = health(agent) if checks else None
    busy0, total0 = cpu_times()
    pid = agent.proc.pid  # its main thread is the loop's
    a0, m0, l0, w0 = ticks(pid), ticks(pid, pid), ticks(listener), time.perf_counter()
    time.sleep(cfg.window / 2)
    sync = change(agent, rules, idents)
    time.sleep(max(0.0, cfg.window - (time.perf_counter() - w0)))
    a1, m1, l1, wall = ticks(pid), ticks(pid, pid), ticks(listener), time.perf_counter() - w0
    busy1, total1 = cpu_times()
    out: dict[str, Any] = {"window_s": round(wall, 2), "cpu_ticks": a1 - a0,
                           "cpu_percent": round((a1 - a0) / CLK_TCK / wall * 100, 3),
                           "loop_cpu_percent": round((m1 - m0) / CLK_TCK / wall * 100, 3),
                           "listener_cpu_percent": round((l1 - l0) / CLK_TCK / wall * 100, 3),
                           "machine_busy": round((busy1 - busy0) / max(1, total1 - total0), 3), "sync": sync,
                           "memory": {"rss_kb": (vm := agent.status())["VmRSS"], "hwm_kb": vm["VmHWM"]}}
    if h0 is not None:
        h1 = health(agent)
        done = sum(n - h0["by"].get(t, 0) for t, n in h1["by"].items())  # the changed identity's new target too
        span = h1["at"] - h0["at"]
        stretch = (h0["stretch"] + h1["stretch"]) / 2  # the prober may restretch within the window
        out.update(targets=h1["targets"], stretch=h1["stretch"], stretch_start=h0["stretch"],
                   interval_s=round(1.0 * h1["stretch"], 3), checks=done, checks_per_s=round(done / span, 1),
                   expected_per_s=round(h1["targets"] / stretch, 1), down=h1["down"],
                   fail_open=h1["fail_open"], status_s=round(h1["asked_s"], 3))
    return out


def show(agent: Agent, ns: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run(in_ns(ns, [PYTHON, "-m", "agent.cli", "show", "--json", "--state-dir", str(agent.state)]),
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=child_env())
    health_ = ((json.loads(proc.stdout).get("agent") or {}).get("health") or {}) if proc.returncode == 0 else {}
    return {"rc": proc.returncode, "seconds": round(time.perf_counter() - t0, 2),
            "targets": len(health_.get("targets", [])), "stretch": health_.get("stretch")}


def case(label: str, n: int, checks: bool, cfg: Config, refuse: bool = False) -> dict[str, Any]:
    log(f"{label}: {n:,} identities x {ids_mod.BACKENDS}, checks {'on' if checks else 'off'}")
    with world(n, refuse) as (ns, rules, idents, listener), tempfile.TemporaryDirectory(prefix="natgw-checks-") as work:
        agent = Agent(ns, ["--from-dir", str(rules)], Path(work), checks=checks)
        try:
            agent.start()
            res: dict[str, Any] = {"label": label, "n": n, "checks_on": checks, "refused": REFUSED if refuse else None,
                                   "ready_s": round(agent.wait_ready(600.0), 2), "agent_pid_measured": agent.is_agent()}
            res["first_sync"] = next(({k: s.get(k) for k in ("seconds", "commands", "backends")}
                                      for s in agent.synced()), None)
            res["settle"] = (settle(agent, cfg, n if refuse else 0) if checks
                             else {"settled": True, "seconds": round(common.settle(5.0), 1)})
            st = res["settle"]
            log(f"  ready in {res['ready_s']} s; {'settled' if st['settled'] else 'NOT settled'} in {st['seconds']} s"
                + (f", stretch {st['stretches'][-1]}, {st['downs'][-1]:,} down" if checks else ""))
            res.update(measure(agent, listener, cfg, rules, idents, checks))
            res["show"] = show(agent, ns)
            warned = [e for e in agent.events() if e.get("event") == STRETCHED]
            res["warned"] = {"times": len(warned), "last_stretch": warned[-1].get("stretch") if warned else None,
                             "cpu_per_check_us": warned[-1].get("cpu_per_check_us") if warned else None}
            res["alive"] = agent.alive()
            log(f"  {res['cpu_percent']:.2f}% of a core; " + (f"{res['checks_per_s']}/s checks (expected "
                f"{res['expected_per_s']}), stretch {res['stretch']:.2f}; " if checks else "")
                + f"sync {res['sync']}; show rc {res['show']['rc']} in {res['show']['seconds']} s")
            return res
        finally:
            agent.stop()


def run(cfg: Config) -> dict[str, Any]:
    t0 = time.perf_counter()
    result: dict[str, Any] = {"config": cfg._asdict(), "machine": machine(), "code": common.code(), "pid": os.getpid(),
                              "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "clk_tck": CLK_TCK,
                              "loadavg_start": os.getloadavg()[0], "cases": []}
    result["cases"].append(case("off", cfg.n, False, cfg))
    result["cases"].append(case("on", cfg.n, True, cfg))
    if cfg.small:
        result["cases"].append(case("small", cfg.small, True, cfg))
    if cfg.refused:
        result["cases"].append(case("refused", cfg.n, True, cfg, refuse=True))
    off, on = result["cases"][0], result["cases"][1]
    result["extra_cpu_percent"] = round(on["cpu_percent"] - off["cpu_percent"], 3)
    result["runtime_s"], result["loadavg_end"] = round(time.perf_counter() - t0, 1), os.getloadavg()[0]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK.n:,} identities, {QUICK.window:g} s windows")
    ap.add_argument("--n", type=int, help="identities of the main cases")
    ap.add_argument("--window", type=float, help="seconds of CPU measured per case")
    ap.add_argument("--json", type=Path, help="write the result here too")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        ap.error("must run as root (it creates network namespaces)")
    cfg = QUICK if args.quick else FULL
    cfg = cfg._replace(**{k: v for k, v in (("n", args.n), ("window", args.window)) if v is not None})
    common.install_signal_handlers()
    result = run(cfg)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
