"""The health checks section of BENCHMARKS.md from bench.checks' JSON (the agent's CPU with
checks off and on, checks a second, the stretch, a sync during the checks):

    python -m bench.checks_report build/bench-checks.json [--out BENCHMARKS.md]"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

from bench.report import CHECKS_HEADING as HEADING, splice_section

BUDGET = 5.0  # % of a core: issue 23's, and settings.health_cpu_budget's default


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def _sync(s: dict[str, Any]) -> str:
    if s.get("logged_s") is None:
        return "NOT logged in 30 s"
    return f"{_ms(s['logged_s'])} ({_ms(s.get('seconds'))}, {_ms(s.get('waited'))})"


def _done(c: dict[str, Any]) -> str:
    """Seconds between two checks of a target, as done in the window."""
    return f"{c['targets'] / c['checks_per_s']:.1f} s" if c["checks_per_s"] > 0 else "no check done"


def _warned(c: dict[str, Any]) -> str:
    w = c.get("warned") or {}
    if not w.get("times"):
        return "no" if c.get("stretch", 1.0) <= 1.0 else "NO (stretched without saying so)"
    return f"{w['times']}x, last at x{w['last_stretch']:g} ({w['cpu_per_check_us']:g} us a check)"


def markdown(result: dict[str, Any], command: str) -> str:
    cases, m, cfg = result["cases"], result["machine"], result["config"]
    off, on = cases[0], cases[1]
    out = [HEADING, "",
           f"`{command}` on {m['nproc']} x {m['cpu']}, kernel {m['kernel']}, {m['nft']}, Python {m['python']}; "
           f"started {result['started']}, {result['runtime_s']:.0f} s, 1-minute load average "
           f"{result['loadavg_start']:.2f} / {result['loadavg_end']:.2f} at start / end. The agent as a process "
           "(`run --from-dir`) in a fresh network namespace per case, on N identities x 4 distinct backends "
           "(10.1.x.y:8080), every one answering: the backends' prefix is local on lo and a listener process "
           "accepts and closes on port 8080 (on loopback the handshake's kernel work for both ends runs in the "
           "agent's process, so its CPU is more than a remote backend would cost it). After the first sync, and "
           "once the stretch holds still (three answers of the status socket within 10%), the agent's "
           f"utime+stime (/proc/PID/stat) over a {cfg['window']:g} s window, in the middle of which one rules "
           "file is rewritten (one identity's backend replaced), in every case alike. Checks a second: the "
           "targets' `checks` counts (`show --json`'s agent.health) before and after the window. Defaults: "
           "interval 1 s, timeout 1 s, CPU budget 5% of one core. Nothing here is asserted.", "",
           "| | " + " | ".join(c["label"] for c in cases) + " |", "|---|" + "---:|" * len(cases)]

    def row(name: str, cell: Callable[[dict[str, Any]], str], checked: bool = False) -> None:
        out.append(f"| {name} | " + " | ".join(cell(c) if c["checks_on"] or not checked else "-" for c in cases) + " |")

    row("identities x 4 (targets)", lambda c: f"{c['n']:,} x 4" + (f" ({c['targets']:,})" if c["checks_on"] else ""))
    row("health checks", lambda c: ("on" if c["checks_on"] else "off (`--no-health-checks`)")
        + (f"; {c['refused']}" if c.get("refused") else ""))
    row("agent CPU, % of a core", lambda c: f"{c['cpu_percent']:.2f} %")
    row("more than checks off", lambda c: f"{c['cpu_percent'] - off['cpu_percent']:+.2f} points", checked=True)
    row("of it, the loop's thread / the others", lambda c: f"{c['loop_cpu_percent']:.2f} % / "
        f"{c['cpu_percent'] - c['loop_cpu_percent']:.2f} %")
    row("checks a second (targets / stretch)", lambda c: f"{c['checks_per_s']:,.0f} ({c['expected_per_s']:,.0f})",
        checked=True)
    row("stretch, start -> end of the window", lambda c: f"{c['stretch_start']:.2f} -> {c['stretch']:.2f}",
        checked=True)
    row("effective interval: as stretched / as done (targets / checks a second)",
        lambda c: f"{c['interval_s']:.1f} s / {_done(c)}", checked=True)
    row("stretch logged", _warned, checked=True)
    row("settled after", lambda c: f"{c['settle']['seconds']:.0f} s" + ("" if c["settle"]["settled"] else
                                                                       " (NOT settled)"))
    row("targets down / identities failing open", lambda c: f"{c['down']:,} / {c['fail_open']:,}"
        + (f" ({c['n']:,} refused)" if c.get("refused") else ""), checked=True)
    row("sync mid-window: write -> logged (seconds, waited)", lambda c: _sync(c["sync"]))
    row("`show --json` after the window", lambda c: f"rc {c['show']['rc']}, {c['show']['seconds']:.1f} s")
    row("agent resident memory at the end (peak)", lambda c: "-" if "memory" not in c else
        f"{c['memory']['rss_kb'] / 1024:.0f} MB ({c['memory']['hwm_kb'] / 1024:.0f} MB)")
    row("listener's CPU / machine busy",
        lambda c: f"{c['listener_cpu_percent']:.1f} % / {c['machine_busy'] * 100:.0f} %")
    extra = result["extra_cpu_percent"]
    verdict = "within it" if extra <= BUDGET else f"over it by {extra - BUDGET:.2f} points"
    out += ["", f"The checks' cost at {on['n']:,} x 4 ({on['targets']:,} targets): {extra:.2f} points of a core "
            f"more than with checks off (budget {BUDGET:g}%: {verdict}), the intervals stretched x{on['stretch']:.1f} "
            f"({_done(on)} between two checks of a backend, as done). "
            f"A sync while they ran: {_sync(on['sync'])}, against {_sync(off['sync'])} with checks off."]
    for c in (c for c in cases if c.get("refused")):
        st = c["settle"]
        out += ["", f"With {c['refused']}, {c['n']:,} x 4: {max(st['downs'], default=0):,} of {c['n']:,} targets down "
                f"{st['seconds']:.0f} s after the first sync ({'settled' if st['settled'] else 'NOT settled'}), the "
                f"stretch between x{min(st['stretches'], default=1):g} and x{max(st['stretches'], default=1):g} "
                f"meanwhile; in the window {c['cpu_percent']:.2f}% of a core, {c['loop_cpu_percent']:.2f}% of it "
                f"the loop's thread, {c['checks_per_s']:,.0f} checks a second."]
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"))
    ap.add_argument("--command", default="make bench-checks")
    args = ap.parse_args(argv)
    section = markdown(json.loads(args.result.read_text()), args.command)
    md = args.out.read_text(encoding="utf-8") if args.out.exists() else "# natgw-agent benchmarks\n"
    args.out.write_text(splice_section(md, HEADING, section), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
