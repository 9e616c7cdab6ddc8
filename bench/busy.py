"""The busy neighbour benchmark: `python -m bench.busy [--n 10000] [--json FILE]` (root).

The agent as a process (`python -m agent.cli run --from-dir --no-health-checks`) in a fresh network
namespace holding N identities x 4 backends (bench/identities.py) plus one ClientIP
identity with pinned clients, while another table in that namespace commits every
100 ms (`python -m lab.neighbour --interval 0.1`). Measured:

  cpu       the agent's utime+stime (/proc/PID/stat) over a window at rest, as % of one
            core: without the neighbour, then beside it
  repairs   a flushed chain, a deleted map element, a deleted set (each one `nft -f -`
            transaction): from `nft` returning to the agent's table, read back over
            netlink (agent.kernel.nftread.read_table) by a probe process in the namespace,
            equalling what it was before; several repetitions each
  show/diff `python -m agent.cli show`, `show --json`, `diff --gateway gw1 --from-dir`:
            wall time, run from the probe
  scrape    GET /metrics from the probe: the first scrape and later ones
  restart   SIGKILL, start again, until the status socket answers ready; the restarted
            agent must send nothing and keep every pinned client
  readback  with the neighbour stopped: one full read-back (KernelView.read())

Progress goes to stderr, one JSON document to stdout (and --json FILE). The targets are
reported against, never asserted: a missed target is a finding, not a failure."""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.core.layout import (
    affinity_set,
    backend_map,
    pattern_chain,
    slot_chain,
    sticky_chain,
)
from bench import identities as ids_mod
from bench.agent_driver import GATEWAY, METRICS_URL, Agent
from bench.common import (PYTHON, REPO, Probe, child_env, cleanup_stale, code, cpu_times, end, in_ns,
                          install_signal_handlers, machine, namespace, settle, wait_for)

TABLE = "natgw"
NEIGHBOUR_INTERVAL = 0.1
CLIENTS = 20  # pinned clients of the ClientIP identity, spread over its 4 slots
CLK_TCK = os.sysconf("SC_CLK_TCK")

# The targets, reported against (not asserted): (key, limit, unit).
TARGETS = {
    "cpu_neighbour": (5.0, "% of a core"),
    "repair": (1.0, "s"),
    "restart_ready": (5.0, "s"),
    "show": (5.0, "s"),
    "show_json": (5.0, "s"),
    "diff": (5.0, "s"),
    "scrape": (0.1, "s"),
    "readback": (1.0, "s"),
}


def log(msg: str) -> None:
    print(f"busy: {msg}", file=sys.stderr, flush=True)


def _stats(xs: list[float]) -> dict[str, float | None]:
    return {"median": statistics.median(xs) if xs else None, "max": max(xs) if xs else None}


# --- the neighbour ----------------------------------------------------------------------

class Neighbour:
    """lab.neighbour in the namespace: another table committing every interval."""

    def __init__(self, ns: str, interval: float = NEIGHBOUR_INTERVAL) -> None:
        self.proc = subprocess.Popen(in_ns(ns, [PYTHON, "-m", "lab.neighbour", "--interval", str(interval)]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                                     env=child_env())
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().strip()
        if first != "ready":
            end(self.proc)
            raise RuntimeError(f"the neighbour did not start: {first!r}")

    def stop(self) -> dict[str, Any]:
        try:
            out, _ = self.proc.communicate(timeout=15)  # stdin closed: it ends
            return json.loads(out.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            end(self.proc)
            return {"commits": None, "failures": None}


# --- what is measured ------------------------------------------------------------------

def cpu_window(agent: Agent, seconds: float) -> dict[str, Any]:
    """The agent's CPU over `seconds` at rest, as % of one core; and how busy the whole
    machine was meanwhile (others' load shows there)."""
    busy0, total0 = cpu_times()
    a0, c0 = agent.ticks()
    w0 = time.perf_counter()
    time.sleep(seconds)
    a1, c1 = agent.ticks()
    wall = time.perf_counter() - w0
    busy1, total1 = cpu_times()
    return {"percent": (a1 - a0) / CLK_TCK / wall * 100, "ticks": a1 - a0, "children_ticks": c1 - c0,
            "wall_s": wall, "machine_busy": (busy1 - busy0) / max(1, total1 - total0)}


def drifts(n: int) -> dict[str, dict[str, Any]]:
    """The damage, as one `nft -f -` transaction each (several commands in one batch, so
    the agent cannot repair between them), and the map elements it touches."""
    t = f"ip {TABLE}"
    victim = ids_mod.identities(n, False)[ids_mod.changed_index(n)]
    return {
        "flushed chain": {"script": f"flush chain {t} {slot_chain(0)}\n", "watch": [], "what": f"`{slot_chain(0)}`"},
        "deleted map element": {
            "script": f"delete element {t} {backend_map(1)} {{ {victim.eip} . tcp . {victim.port} }}\n",
            "watch": [[backend_map(1), victim.eip, victim.proto, victim.port]], "what": f"one identity's element in `{backend_map(1)}`"},
        "deleted set": {
            "script": (f"flush chain {t} {pattern_chain(tuple(range(ids_mod.BACKENDS)), ids_mod.TIMEOUT)}\n"
                       f"flush chain {t} {sticky_chain(0, ids_mod.TIMEOUT)}\n"
                       f"delete set {t} {affinity_set(0)}\n"),
            "watch": [], "what": f"`{affinity_set(0)}`, its two user chains flushed first"},
    }


def pin_script(eip: str, port: int) -> str:
    """Affinity entries for CLIENTS clients, client c on slot c % 4, as the kernel's
    `update` statement would have added them for a first connection."""
    return "".join(f"add element ip {TABLE} {affinity_set(c % ids_mod.BACKENDS)} "
                   f"{{ 172.16.0.{c} . {eip} . tcp . {port} timeout {ids_mod.TIMEOUT}s }}\n"
                   for c in range(1, CLIENTS + 1))


def repairs(agent: Agent, probe: Probe, cases: dict[str, dict[str, Any]], reps: int) -> dict[str, Any]:
    """Each damage `reps` times. A random pause before each, so that the damage falls at
    any point of the agent's work (it wakes on the kernel's change notification, and may
    be busy with the neighbour's), not always at the same one."""
    jitter = random.Random(11)
    out: dict[str, Any] = {}
    for name, case in cases.items():
        runs = []
        for rep in range(reps):
            before = probe.ask("snapshot")
            time.sleep(jitter.uniform(0.0, 0.25))
            drifts_before = agent.drifts()
            r = probe.ask("damage", script=case["script"], watch=case["watch"], timeout=10.0)
            time.sleep(0.3)  # the drift line is written before the repair is sent; give the file a moment
            r["drift_logged"] = agent.drifts() > drifts_before
            r["real"] = r.get("nft_rc") == 0 and r["drift_logged"]  # the agent saw the damage and said so
            r.setdefault("repair_s", None)
            r["before_identities"] = before.get("identities")
            runs.append(r)
            log(f"  {name} #{rep + 1}: nft {r.get('nft_s', 0) * 1e3:.0f} ms, repaired "
                f"{'in %.0f ms' % (r['repair_s'] * 1e3) if r['repair_s'] is not None else 'NOT'}"
                f" (polls {r.get('polls')}, damage seen {r.get('seen_damaged')}, drift logged {r['drift_logged']})")
            time.sleep(0.5)
        times = [r["repair_s"] for r in runs if r["repair_s"] is not None]
        out[name] = {"what": case["what"], "runs": runs, "seconds": times, **_stats(times),
                     "all_repaired": len(times) == reps and all(r["real"] for r in runs)}
    return out


def commands(probe: Probe, agent: Agent, rules: Path) -> dict[str, Any]:
    cli = [PYTHON, "-m", "agent.cli"]
    jobs = {
        "show": ([*cli, "show", "--state-dir", str(agent.state)], "show"),
        "show_json": ([*cli, "show", "--json", "--state-dir", str(agent.state)], "show-json"),
        "diff": ([*cli, "diff", "--gateway", GATEWAY, "--from-dir", str(rules)], "diff"),
    }
    out = {}
    for name, (argv, parse) in jobs.items():
        out[name] = probe.ask("run", argv=argv, parse=parse, timeout=300)
        log(f"  {name}: {out[name]['seconds']:.2f} s, rc {out[name]['rc']}")
    return out


def scrapes(probe: Probe, later: int) -> dict[str, Any]:
    first = probe.ask("scrape", url=METRICS_URL)
    time.sleep(2.0)  # the first scrape asked for the backend counters, read in the background
    rest = []
    for _ in range(later):
        rest.append(probe.ask("scrape", url=METRICS_URL))
        time.sleep(0.5)
    log(f"  first {first['seconds'] * 1e3:.1f} ms ({first['bytes']:,} bytes), later "
        + ", ".join(f"{s['seconds'] * 1e3:.1f}" for s in rest) + f" ms ({rest[-1]['bytes'] if rest else 0:,} bytes)")
    times = [s["seconds"] for s in rest]
    return {"first": first, "later": rest, "first_s": first["seconds"], "later_s": times, "later_median_s":
            _stats(times)["median"], "later_max_s": _stats(times)["max"]}


def restart(agent: Agent, probe: Probe, expected: int) -> dict[str, Any]:
    before = probe.ask("snapshot")
    pins = before["entries"]
    rc = agent.stop(signal.SIGKILL)
    t0 = time.perf_counter()
    agent.start()
    wait_for(agent.ready, 120, 0.01, "the restarted agent ready")
    ready_s = time.perf_counter() - t0
    time.sleep(2.0)  # anything it would send comes with its first sync; drift checks run meanwhile
    after = probe.ask("compare")
    events = agent.events()
    start = max(i for i, e in enumerate(events) if e.get("event") == "starting")
    sent = [e for e in events[start:] if e.get("event") in ("synced", "transaction") or "drift" in str(e.get("event"))]
    kept = {name: sorted(set(keys) - set(after["entries"].get(name, []))) for name, keys in pins.items()}
    lost = {name: keys for name, keys in kept.items() if keys}
    res = {"killed_rc": rc, "ready_s": ready_s, "sent": sent[:5], "sent_nothing": not sent,
           "table_unchanged": after["equal"], "pins": sum(len(k) for k in pins.values()), "pins_lost": lost,
           "pins_kept": not lost and sum(len(k) for k in pins.values()) > 0,
           "identities": before.get("identities"), "expected_identities": expected}
    log(f"  ready in {ready_s:.2f} s; sent nothing {res['sent_nothing']}, table unchanged {res['table_unchanged']}, "
        f"{res['pins']} pins kept {res['pins_kept']}")
    return res


def targets(res: dict[str, Any]) -> dict[str, Any]:
    """Each measurement against the issue's target: the value compared and whether it met it."""
    rep = res["repairs"]
    values = {
        "cpu_neighbour": res["cpu"]["neighbour"]["percent"],
        "repair": max((r["max"] for r in rep.values() if r["max"] is not None), default=None)
        if all(r["all_repaired"] for r in rep.values()) else None,
        "restart_ready": res["restart"]["ready_s"] if res["restart"]["sent_nothing"] and res["restart"]["pins_kept"]
        else None,
        "show": res["commands"]["show"]["seconds"] if res["commands"]["show"]["rc"] == 0 else None,
        "show_json": res["commands"]["show_json"]["seconds"] if res["commands"]["show_json"]["rc"] == 0 else None,
        "diff": res["commands"]["diff"]["seconds"] if res["commands"]["diff"]["rc"] == 0 else None,
        "scrape": max([res["scrape"]["first_s"], *res["scrape"]["later_s"]]),
        "readback": res["readback"]["first_s"],
    }
    return {k: {"target": TARGETS[k][0], "unit": TARGETS[k][1], "value": v, "met": v is not None and v <= TARGETS[k][0]}
            for k, v in values.items()}


def checks(res: dict[str, Any], n: int) -> dict[str, bool]:
    """That what was measured is real (never a time)."""
    c = res["commands"]
    return {
        "agent_pid_measured": res["agent_pid_measured"],
        "programmed": res["programmed_identities"] == n + 1,
        "pins_added": res["pins"] == CLIENTS,
        "neighbour_busy": bool(res["neighbour"].get("commits")) and res["neighbour"].get("failures") == 0,
        **{f"repaired: {name}": r["all_repaired"] for name, r in res["repairs"].items()},
        "restart_sent_nothing": res["restart"]["sent_nothing"],
        "restart_table_unchanged": res["restart"]["table_unchanged"],
        "restart_pins_kept": res["restart"]["pins_kept"],
        "show_lists_everything": c["show"]["rc"] == 0 and c["show"]["identities"] == n + 1
        and c["show"]["backends"] == (n + 1) * ids_mod.BACKENDS,
        "show_json_lists_everything": c["show_json"]["rc"] == 0 and c["show_json"]["identities"] == n + 1
        and c["show_json"]["agent_ready"] is True,
        "diff_converged": c["diff"]["rc"] == 0 and c["diff"]["empty"],
        "scrapes_answered": all(s["status"] == 200 and s["identities"] == n + 1
                                for s in [res["scrape"]["first"], *res["scrape"]["later"]]),
        "readback_complete": all(r["identities"] == n + 1 for r in res["readback"]["runs"]),
    }


def run(n: int, reps: int, cpu_seconds: float, later_scrapes: int, readbacks: int) -> dict[str, Any]:
    started = time.perf_counter()
    m = machine()
    m["os"] = next((line.split("=", 1)[1].strip().strip('"') for line in Path("/etc/os-release").read_text().splitlines()
                    if line.startswith("PRETTY_NAME=")), "unknown")
    res: dict[str, Any] = {"n": n, "backends": ids_mod.BACKENDS, "reps": reps, "cpu_window_s": cpu_seconds,
                           "clk_tck": CLK_TCK, "pid": os.getpid(), "code": code(),
                           "neighbour_interval_s": NEIGHBOUR_INTERVAL, "clients": CLIENTS, "machine": m,
                           "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                           "loadavg_start": os.getloadavg()[0]}
    idents = ids_mod.identities(n, False)
    sticky = ids_mod.identities(n + 1, True)[n]  # the ClientIP identity: an EIP of its own
    work = Path(tempfile.mkdtemp(prefix="natgw-busy-"))
    rules = work / "rules"
    try:
        ids_mod.write_manifests(rules, [*idents, sticky])
        with namespace() as ns:
            probe = Probe(ns, "bench.busy_probe")
            # No health checks: nothing answers at the 40,000 backend addresses, and their
            # checks (5% of a core, budgeted) would take them out a few at a time throughout,
            # not the neighbour's effect this measures (bench/checks.py measures theirs).
            agent = Agent(ns, ["--from-dir", str(rules)], work, checks=False)
            neighbour: Neighbour | None = None
            try:
                log(f"{ns}: agent starting with {n:,} identities x {ids_mod.BACKENDS} + 1 ClientIP")
                t0 = time.perf_counter()
                agent.start()
                wait_for(agent.ready, 300, 0.05, "the agent ready")
                res["first_ready_s"] = time.perf_counter() - t0
                res["agent_pid_measured"] = agent.is_agent()
                wait_for(lambda: probe.ask("snapshot").get("identities") == n + 1, 120, 0.5, "every identity programmed")
                res["programmed_s"] = time.perf_counter() - t0
                res["programmed_identities"] = n + 1
                pinned = probe.ask("nft", script=pin_script(sticky.eip, sticky.port))
                if pinned["rc"] != 0:
                    raise RuntimeError(f"pinning clients failed: {pinned['stderr']}")
                snap = probe.ask("snapshot")
                res["table"] = {k: snap[k] for k in ("identities", "elements", "chains", "sets")}
                res["pins"] = sum(len(v) for v in snap["entries"].values())
                log(f"ready in {res['first_ready_s']:.1f} s, programmed in {res['programmed_s']:.1f} s; "
                    f"{res['pins']} clients pinned; {res['table']}")

                settle(10)
                log(f"cpu at rest, no neighbour ({cpu_seconds:.0f} s)")
                res["cpu"] = {"quiet": cpu_window(agent, cpu_seconds)}
                neighbour = Neighbour(ns)
                time.sleep(1.0)
                log(f"cpu at rest beside the neighbour ({cpu_seconds:.0f} s)")
                res["cpu"]["neighbour"] = cpu_window(agent, cpu_seconds)
                log("  " + ", ".join(f"{k}: {v['percent']:.2f}% of a core (machine {v['machine_busy'] * 100:.0f}% busy)"
                                     for k, v in res["cpu"].items()))

                log(f"repairs beside the neighbour, {reps} each")
                res["repairs"] = repairs(agent, probe, drifts(n), reps)
                # The deleted set took its clients' entries with it: pin them again.
                again = probe.ask("nft", script=pin_script(sticky.eip, sticky.port))
                if again["rc"] != 0:
                    raise RuntimeError(f"pinning clients again failed: {again['stderr']}")

                log("show, show --json, diff beside the neighbour")
                res["commands"] = commands(probe, agent, rules)
                log("metrics scrapes beside the neighbour")
                res["scrape"] = scrapes(probe, later_scrapes)
                log("restart beside the neighbour (SIGKILL, start)")
                res["restart"] = restart(agent, probe, n + 1)
                res["neighbour"] = neighbour.stop()
                neighbour = None
                log(f"neighbour: {res['neighbour']}")

                settle(10)
                log("full read-back, quiet")
                runs = [probe.ask("read") for _ in range(readbacks)]
                res["readback"] = {"runs": runs, "first_s": runs[0]["seconds"],
                                   **_stats([r["seconds"] for r in runs])}
                log("  " + ", ".join(f"{r['seconds'] * 1e3:.0f} ms" for r in runs))
                res["agent_stopped_rc"] = agent.stop()
            except BaseException:
                if agent.proc is not None:
                    log("agent log tail:\n" + agent.tail())
                raise
            finally:
                if neighbour is not None:
                    neighbour.stop()
                agent.stop()
                probe.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["runtime_s"] = time.perf_counter() - started
    res["loadavg_end"] = os.getloadavg()[0]
    res["targets"] = targets(res)
    res["checks"] = checks(res, n)
    res["ok"] = all(res["checks"].values())
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.busy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=10000, help="identities (4 backends each), plus one ClientIP")
    p.add_argument("--reps", type=int, default=5, help="repetitions of each repair")
    p.add_argument("--cpu-seconds", type=float, default=10.0, help="each CPU window")
    p.add_argument("--scrapes", type=int, default=5, help="scrapes after the first")
    p.add_argument("--readbacks", type=int, default=3, help="quiet full read-backs")
    p.add_argument("--json", type=Path, help="also write the results to this file")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("must run as root (it creates a network namespace)")
    install_signal_handlers()
    stale = cleanup_stale()
    if stale:
        log(f"removed namespaces of an earlier, killed run: {', '.join(stale)}")
    res = run(args.n, args.reps, args.cpu_seconds, args.scrapes, args.readbacks)
    doc = json.dumps(res, indent=1, default=str)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(doc + "\n")
    print(doc)
    failed = [k for k, v in res["checks"].items() if not v]
    missed = [k for k, v in res["targets"].items() if not v["met"]]
    log(f"done in {res['runtime_s']:.0f} s; checks {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}; "
        f"targets {'all met' if not missed else 'missed: ' + ', '.join(missed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; namespace removed", file=sys.stderr)
        sys.exit(130)
