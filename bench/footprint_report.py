"""The footprint section of BENCHMARKS.md from bench.footprint's JSON (memory per size,
reaction, idle CPU; each code version side by side, against issue 13's targets):

    python -m bench.footprint_report build/bench-footprint.json [--out BENCHMARKS.md]"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.report import FOOTPRINT_HEADING as HEADING, splice_section


def _mem(version: dict[str, Any], n: int, affinity: bool) -> dict[str, Any] | None:
    return next((m for m in version["memory"] if m["n"] == n and m["affinity"] == affinity), None)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def _histogram_quantile(hist: dict[str, int], q: float) -> str:
    """The bucket bound a quantile falls under (Prometheus' histogram_quantile, without
    interpolation): what the agent's own histogram says."""
    buckets = sorted(((float(le), c) for le, c in hist.items()), key=lambda x: x[0])
    if not buckets or buckets[-1][1] == 0:
        return "-"
    total = buckets[-1][1]
    for le, count in buckets:
        if count >= q * total:
            return "> 30 s" if le == float("inf") else f"<= {le * 1000:g} ms"
    return "-"


def _per_thousand(version: dict[str, Any], affinity: bool, sizes: list[int]) -> str:
    """Resident MB per 1,000 identities between the smallest and largest size: linear
    growth shows as the same slope between every pair."""
    points = [(n, m["rss_mb"]) for n in sizes if (m := _mem(version, n, affinity))]
    if len(points) < 2:
        return "-"
    slopes = [f"{(b - a) / ((m - n) / 1000):.1f}" for (n, a), (m, b) in zip(points, points[1:])]
    return " / ".join(slopes)


def _bursts(version: dict[str, Any]) -> str:
    """How many bursts became one transaction, two, ...: "8 of 10 in one, 2 in two"."""
    per = (version.get("reaction") or {}).get("transactions_per_burst") or []
    if not per:
        return "-"
    words = {1: "one", 2: "two", 3: "three"}
    counts = sorted((t, per.count(t)) for t in set(per))
    return f"{counts[0][1]} of {len(per)} in {words.get(counts[0][0], counts[0][0])}" + "".join(
        f", {c} in {words.get(t, t)}" for t, c in counts[1:])


def markdown(result: dict[str, Any], command: str) -> str:
    versions = result["versions"]
    sizes = result["sizes"]
    m = result["machine"]
    labels = [v["label"] for v in versions]
    out = [HEADING, "",
           f"`{command}` on {m['nproc']} x {m['cpu']}, kernel {m['kernel']}, {m['nft']}, Python {m['python']}. "
           "The agent as a process on the Kubernetes path, as in a gateway pod: the real `kubernetes` client over TLS "
           "to the fake API server in the gateway's namespace, which holds N identities x 4 rules with the metadata "
           "the API returns (~1.5 KB a rule), without health checks (nothing answers at those backends; the health "
           "checks section gives their cost). Each code version measured the same way in the same run; targets "
           "(issue 13) are reported, never asserted.", "",
           "### Resident memory after the first sync (peak so far)", "",
           "| identities x 4 | mode | " + " | ".join(labels) + " | after / before |",
           "|---|---|" + "---|" * len(labels) + "---|"]
    for affinity in (False, True):
        for n in sizes:
            cells = []
            for v in versions:
                mm = _mem(v, n, affinity)
                cells.append(f"{mm['rss_mb']:.0f} MB ({mm['peak_mb']:.0f} MB)" if mm else "-")
            first, last = _mem(versions[0], n, affinity), _mem(versions[-1], n, affinity)
            ratio = _ratio(last and last["rss_mb"], first and first["rss_mb"]) if len(versions) > 1 else "-"
            out.append(f"| {n:,} | {'ClientIP' if affinity else 'stateless'} | " + " | ".join(cells) + f" | {ratio} |")
    out += ["", "MB per 1,000 identities between the sizes (" + " -> ".join(f"{n:,}" for n in sizes) + "): " + "; ".join(
        f"{v['label']}: stateless {_per_thousand(v, False, sizes)}, ClientIP {_per_thousand(v, True, sizes)}"
        for v in versions) + ". The same slope between each pair is linear growth."]
    this = versions[-1]
    targets = []
    for affinity in (False, True):
        mm = _mem(this, 10000, affinity)
        if mm:
            mode = "ClientIP" if affinity else "stateless"
            targets.append(f"10,000 x 4 {mode}: resident {mm['rss_mb']:.0f} MB (target <= 100: "
                           f"{'met' if mm['rss_mb'] <= 100 else 'NOT met'}), peak {mm['peak_mb']:.0f} MB (target <= 200: "
                           f"{'met' if mm['peak_mb'] <= 200 else 'NOT met'})")
    out += ["", "Targets, " + this["label"] + ": " + "; ".join(targets) + "."]
    for v in versions:
        out += _where_it_goes(v)
    if len(versions) > 1 and not versions[0].get("traced"):
        out += ["", f"{versions[0]['label']}: its breakdown was not measured in this run. What changed between the "
                "two is in docs/speed.md, \"Memory, reaction and rest\"."]
    out += ["", "### Reaction at 10,000 identities (stateless)", "",
            "| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]

    def row(name: str, cell: Any) -> None:
        out.append(f"| {name} | " + " | ".join(cell(v) for v in versions) + " |")

    def waited(v: dict[str, Any], q: str) -> str:
        w = (v.get("reaction") or {}).get("waited")
        return _ms(w.get(q)) if w else "not logged"

    row("watch event -> kernel, p50 (the agent's log)", lambda v: waited(v, "p50_ms"))
    row("watch event -> kernel, p99 (the agent's log)", lambda v: waited(v, "p99_ms"))
    row("watch event -> kernel, max (the agent's log)", lambda v: waited(v, "max_ms"))
    row("p50 / p99 by the agent's histogram (every sync since start, the first full one included)", lambda v: " / ".join(
        _histogram_quantile((v.get("reaction") or {}).get("histogram") or {}, q) for q in (0.5, 0.99)))
    row("bursts of 20 events at once: transactions each", lambda v: _bursts(v))
    row("API write -> first connection answered, p50", lambda v: _ms((v.get("traffic") or {}).get("p50_ms")))
    row("API write -> first connection answered, p99", lambda v: _ms((v.get("traffic") or {}).get("p99_ms")))
    row("idle 60 s: CPU, % of a core", lambda v: f"{(v.get('idle') or {}).get('cpu_percent', float('nan')):.3f} %")
    row("idle 60 s: wake-ups per second", lambda v: f"{(v.get('idle') or {}).get('wakeups_per_s', float('nan')):.2f}")
    w = (this.get("reaction") or {}).get("waited") or {}
    idle = this.get("idle") or {}
    out += ["", f"Targets, {this['label']}: p50 <= 5 ms ({'met' if (w.get('p50_ms') or 1e9) <= 5 else 'NOT met'}), "
            f"p99 <= 20 ms ({'met' if (w.get('p99_ms') or 1e9) <= 20 else 'NOT met'}), "
            f"bursts in one transaction ({_bursts(this)}), "
            f"idle CPU <= 0.1% ({'met' if idle.get('cpu_percent', 1e9) <= 0.1 else 'NOT met'}).", ""]
    return "\n".join(out)


def _where_it_goes(version: dict[str, Any]) -> list[str]:
    """Python's objects by allocating file, and glibc's heap, of one version at 10,000 stateless."""
    traced = version.get("traced") or {}
    py = traced.get("python")
    if not py:
        return []
    rows = ", ".join(f"{f['file']} {f['kib'] / 1024:.1f} MB" for f in py["by_file"][:8])
    malloc = traced.get("malloc") or {}
    return ["", f"Where it goes, {version['label']} at 10,000 stateless (PYTHONTRACEMALLOC=1, which itself costs "
            f"memory): resident {traced.get('rss_kib', 0) / 1024:.0f} MB; Python objects {py['traced_kib'] / 1024:.1f} MB, "
            f"by allocating file: {rows}; glibc's heap {malloc.get('in_use_kib', 0) / 1024:.1f} MB in use, "
            f"{malloc.get('free_kib', 0) / 1024:.1f} MB free but kept."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"))
    ap.add_argument("--command", default="make bench-footprint")
    args = ap.parse_args(argv)
    section = markdown(json.loads(args.result.read_text()), args.command)
    md = args.out.read_text(encoding="utf-8") if args.out.exists() else "# natgw-agent benchmarks\n"
    args.out.write_text(splice_section(md, HEADING, section), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

