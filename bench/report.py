"""BENCHMARKS.md and benchmarks-sync.png from the results of bench.run; the splicing of
the other benchmarks' sections into that file (each written by the module beside its
benchmark: bench/busy_report.py, bench/cleanup_report.py, bench/footprint_report.py).
The busy neighbour section (one JSON file per system) and the cleanup section:

    python -m bench.report [--busy A.json [B.json ...]] [--cleanup C.json] [--out BENCHMARKS.md]

writes those sections into an existing BENCHMARKS.md (replacing the ones there) and leaves
the rest of the file as bench.run wrote it."""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import choice_report
from bench.sync_driver import LOOP_CHANGES
from bench.identities import BACKENDS, RULES_PER_FILE_IDENTITIES, TIMEOUT

MODES = ((False, "stateless"), (True, f"ClientIP (timeout {TIMEOUT} s)"))
DP_LABELS = {
    "agent": "agent (stateless)",
    "agent-clientip": "agent (ClientIP)",
    "agent-masquerade": "agent (stateless, --masquerade)",
    "iptables-legacy": "iptables linear chain (iptables-legacy)",
    "iptables-nft": "iptables linear chain (iptables-nft)",
}


def fmt_s(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x >= 120:
        return f"{x:.0f} s ({x / 60:.0f} min)"
    if x >= 10:
        return f"{x:.1f} s"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 0.1:
        return f"{x * 1e3:.0f} ms"
    if x >= 0.001:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} µs"


def fmt_us(x: float) -> str:
    return f"{x * 1e6:.1f} µs"


def fmt_ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "n/a"
    r = a / b
    return f"{r:,.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 1.95 else f"{r:.2f}x"


def _find(rows: list[dict[str, Any]], n: int, affinity: bool) -> dict[str, Any] | None:
    return next((r for r in rows if r.get("n") == n and r.get("affinity") == affinity), None)


def _legacy_full(res: dict[str, Any], n: int, affinity: bool) -> tuple[float | None, str]:
    r = _find(res["legacy"], n, affinity)
    if r is not None:
        return r["seconds"], fmt_s(r["seconds"])
    e = _find(res["legacy_extrapolated"], n, affinity)
    if e is not None:
        return None, f"~{fmt_s(e['seconds'])} (extrapolated from {e['extrapolated_from']:,} measured)"
    return None, "n/a"


def _agent_ok(r: dict[str, Any] | None) -> bool:
    return r is not None and "error" not in r


def sync_table(res: dict[str, Any], affinity: bool) -> list[str]:
    lines = [
        "| identities | legacy: one `nft -f` per identity | kube-proxy style: one batch | agent: sync | of which libnftables | agent: directory parse | legacy / agent | kube-proxy / agent |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in res["config"]["sizes"]:
        lg, lg_text = _legacy_full(res, n, affinity)
        kp = _find(res["kubeproxy"], n, affinity)
        ag = _find(res["agent"], n, affinity)
        ag_sync = ag["sync_s"] if _agent_ok(ag) else None
        e = _find(res["legacy_extrapolated"], n, affinity)
        lg_ratio = fmt_ratio(lg, ag_sync) if lg is not None else (
            f"~{fmt_ratio(e['seconds'], ag_sync)} (extrapolated)" if e is not None else "n/a")
        lines.append(
            f"| {n:,} | {lg_text} | {fmt_s(kp['seconds']) if kp else 'n/a'} | {fmt_s(ag_sync)} "
            f"| {fmt_s(ag.get('sync_lib_s')) if _agent_ok(ag) else 'n/a'} | {fmt_s(ag['parse_s']) if _agent_ok(ag) else 'n/a'} "
            f"| {lg_ratio} | {fmt_ratio(kp['seconds'] if kp else None, ag_sync)} |")
    return lines


def _change_cell(seconds: float | None, note: str = "") -> str:
    return fmt_s(seconds) + (f" ({note})" if note else "") if seconds is not None else "n/a"


def change_table(res: dict[str, Any]) -> list[str]:
    sizes = res["config"]["change_sizes"]
    head = " | ".join(f"{n:,} present" for n in sizes)
    lines = [f"| approach | mode | {head} |", "|---|---|" + "---:|" * len(sizes)]
    for affinity, label in MODES:
        cells = []
        for n in sizes:
            r = _find(res["legacy"], n, affinity)
            ch = r.get("change") if r else next((c for c in res["changes"] if c["present"] == n and c["affinity"] == affinity), None)
            if ch is None:
                cells.append(_legacy_clientip_note(res, affinity))
            else:
                cells.append(_change_cell(ch["seconds"], "1 `nft -f` process"))
        lines.append(f"| legacy | {label.split(' ')[0]} | " + " | ".join(cells) + " |")
        cells = []
        for n in sizes:
            r = _find(res["kubeproxy"], n, affinity)
            ch = r.get("change") if r else None
            cells.append(_change_cell(ch["seconds"], f"+ {fmt_s(ch['cleanup_s'])} deleting the old chain later") if ch else "n/a")
        lines.append(f"| kube-proxy style | {label.split(' ')[0]} | " + " | ".join(cells) + " |")
        cells = []
        for n in sizes:
            ag = _find(res["agent"], n, affinity)
            cells.append(_change_cell(ag["change_s"], f"{ag['change']['commands']} commands") if _agent_ok(ag) else "n/a")
        lines.append(f"| agent: `sync(src.objects())` | {label.split(' ')[0]} | " + " | ".join(cells) + " |")
        cells = []
        for n in sizes:
            ag = _find(res["agent"], n, affinity)
            loop = ag.get("change_loop") if _agent_ok(ag) else None
            cells.append(_change_cell(loop["s"], f"{loop['result']['commands']} commands") if loop else "n/a")
        if any(c != "n/a" for c in cells):
            lines.append(f"| agent: run loop's `sync(src, src.take_changes())` | {label.split(' ')[0]} | " + " | ".join(cells) + " |")
    return lines


def _legacy_clientip_note(res: dict[str, Any], affinity: bool) -> str:
    if not affinity:
        return "n/a"
    m = res["config"]["legacy_clientip_change_max"]
    r = _find(res["legacy"], m, True)
    if r and r.get("change"):
        return f"not measured; with {m:,} present: {fmt_s(r['change']['seconds'])}"
    return "not measured"


def lazy_imports(res: dict[str, Any]) -> list[str]:
    """Packages first imported inside the timed first sync (a one-time cost per process)."""
    seen = sorted({m for a in res["agent"] if _agent_ok(a) for m in a.get("imported_during_sync", [])
                   if not m.startswith("_")})
    if not seen:
        return []
    return [f"The timed first sync of each driver process also imports, for the first time in that process: "
            f"{', '.join(f'`{m}`' for m in seen)}. That one-time cost (tens of milliseconds) is part of the full-sync "
            "figures and dominates them at small sizes.", ""]


def agent_table(res: dict[str, Any]) -> list[str]:
    lines = [
        "| identities | mode | parse | full sync (libnftables) | no-op: `sync(src.objects())` | no-op: run loop's path "
        "| one change: `sync(src.objects())` (libnftables) | one change: run loop's path (libnftables) | the two polls "
        "| `show` | peak RSS |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [(n, label.split(" ")[0], _find(res["agent"], n, affinity))
            for affinity, label in MODES for n in res["config"]["sizes"]]
    rows += [(r["n"], "ClientIP, random first choice", r) for r in res.get("agent_random", [])]
    for n, mode, ag in rows:
        if not _agent_ok(ag):
            lines.append(f"| {n:,} | {mode} | failed: {(ag or {}).get('error', 'not run').splitlines()[0][:80]} |" + " |" * 8)
            continue
        loop = ag.get("change_loop")
        noop_loop = f"{fmt_s(ag['noop_loop_s'])}, {ag['noop_loop_commands']} commands" if "noop_loop_s" in ag else "n/a"
        change_loop = (f"{fmt_s(loop['s'])} ({fmt_s(loop['lib_s'])}), {loop['result']['commands']} commands"
                       if loop else "n/a")
        lines.append(
            f"| {n:,} | {mode} | {fmt_s(ag['parse_s'])} | {fmt_s(ag['sync_s'])} ({fmt_s(ag.get('sync_lib_s'))}) "
            f"| {fmt_s(ag['noop_s'])}, {ag['noop_commands']} commands | {noop_loop} "
            f"| {fmt_s(ag['change_s'])} ({fmt_s(ag.get('change_lib_s'))}), {ag['change']['commands']} commands | {change_loop} "
            f"| {fmt_s(ag['change_poll_s'])} | {fmt_s(ag['show_s'])} | {ag['rss_peak_kib'] / 1024:.0f} MiB |")
    return lines


def dataplane_tables(res: dict[str, Any]) -> list[str]:
    dp = res["dataplane"]
    sizes = res["config"]["dp_sizes"]
    lo, hi = sizes[0], sizes[-1]
    lines = [
        f"| gateway | {lo:,} identities: median (run medians min-max; IQR) | {hi:,} identities: median (run medians min-max; IQR) | {hi:,} / {lo:,} |",
        "|---|---:|---:|---:|",
    ]
    for kind in res["config"]["dp_kinds"]:
        a = next((d for d in dp if d["kind"] == kind and d["n"] == lo), None)
        b = next((d for d in dp if d["kind"] == kind and d["n"] == hi), None)
        if a is None or b is None:
            continue

        def cell(d: dict[str, Any]) -> str:
            c = d["connect"]
            return f"{fmt_us(c['median'])} ({c['run_min'] * 1e6:.1f}-{c['run_max'] * 1e6:.1f}; {c['q1'] * 1e6:.1f}-{c['q3'] * 1e6:.1f})"
        lines.append(f"| {DP_LABELS.get(kind, kind)} | {cell(a)} | {cell(b)} | {b['connect']['median'] / a['connect']['median']:.2f}x |")
    lines += ["", "Side by side (median per-connection time, TCP handshake through the gateway):", "",
              "| identities | agent (stateless) | iptables-legacy linear chain | iptables / agent | iptables-nft linear chain | iptables-nft / agent |",
              "|---:|---:|---:|---:|---:|---:|"]
    for n in sizes:
        def med(kind: str) -> float | None:
            d = next((d for d in dp if d["kind"] == kind and d["n"] == n), None)
            return d["connect"]["median"] if d else None
        ag, il, inft = med("agent"), med("iptables-legacy"), med("iptables-nft")
        lines.append(f"| {n:,} | {fmt_us(ag) if ag else 'n/a'} | {fmt_us(il) if il else 'n/a'} | {fmt_ratio(il, ag)} "
                     f"| {fmt_us(inft) if inft else 'n/a'} | {fmt_ratio(inft, ag)} |")
    return lines


def checks(res: dict[str, Any]) -> list[str]:
    """Every correctness check made during the run, failures first."""
    failed: list[str] = []
    passed = 0

    def note(ok: bool, what: str) -> None:
        nonlocal passed
        if ok:
            passed += 1
        else:
            failed.append(what)

    for r in res["legacy"]:
        note(r["check"]["ok"], f"legacy {r['n']} affinity={r['affinity']}: {r['check']}")
        if r.get("change"):
            note(r["change"]["check"]["ok"], f"legacy change {r['n']}: {r['change']['check']}")
    for c in res["changes"]:
        note(c["check"]["ok"] and c["setup_check"]["ok"], f"legacy change at {c['present']}: {c['check']} {c['setup_check']}")
    for r in res["kubeproxy"]:
        note(r["check"]["ok"], f"kube-proxy {r['n']} affinity={r['affinity']}: {r['check']}")
        if r.get("change"):
            note(r["change"]["check"]["ok"], f"kube-proxy change {r['n']}: {r['change']['check']}")
    for r in [*res["agent"], *res.get("agent_random", [])]:
        note(_agent_ok(r) and r["check"]["ok"], f"agent {r['n']} affinity={r['affinity']}: {r.get('check', r.get('error'))}")
    for d in res["dataplane"]:
        ok = d["errors"] == 0 and not d["unexpected"] and d["connections"] == d["runs"] * res["config"]["dp_connections"]
        note(ok, f"data plane {d['kind']} {d['n']}: errors {d['errors']} {d['error_samples']}, unexpected answers {d['unexpected']}")
    for ok, what in choice_report.checks(res["choice"]):
        note(ok, what)
    lines = [f"{passed} checks passed, {len(failed)} failed."]
    lines += [f"- FAILED: {f}" for f in failed]
    return lines


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(9.5, 6.2), dpi=120)
    colors = {"legacy": "tab:red", "kube-proxy": "tab:blue", "agent": "tab:green"}
    names = {"legacy": "legacy: one nft -f per identity", "kube-proxy": "kube-proxy style: one batch",
             "agent": "agent: Reconciler.sync"}
    sizes = sorted(res["config"]["sizes"])
    labels: list[tuple[float, float, str, str]] = []
    for affinity, _ in MODES:
        style = "--" if affinity else "-"
        mode = "ClientIP" if affinity else "stateless"
        series = {
            "legacy": sorted((r["n"], r["seconds"]) for r in res["legacy"] if r["affinity"] == affinity),
            "kube-proxy": sorted((r["n"], r["seconds"]) for r in res["kubeproxy"] if r["affinity"] == affinity),
            "agent": sorted((r["n"], r["sync_s"]) for r in res["agent"] if r["affinity"] == affinity and _agent_ok(r)),
        }
        for key, pts in series.items():
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=colors[key], linewidth=2)
            labels.append((pts[-1][0], pts[-1][1], f"{_short(pts[-1][1])} {mode}", colors[key]))
        for e in (e for e in res["legacy_extrapolated"] if e["affinity"] == affinity):
            if series["legacy"]:
                x0, y0 = series["legacy"][-1]
                ax.plot([x0, e["n"]], [y0, e["seconds"]], ":", color=colors["legacy"], linewidth=1.2)
            ax.plot([e["n"]], [e["seconds"]], marker="o", markerfacecolor="white", color=colors["legacy"], linestyle="none")
            labels.append((e["n"], e["seconds"], f"~{_short(e['seconds'])} {mode} (extrap.)", colors["legacy"]))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    ax.set_xlim(sizes[0] / 1.6, sizes[-1] * 4.5)
    ax.set_xlabel(f"identities ({BACKENDS} backends each)")
    ax.set_ylabel("full sync from an empty table, seconds (log scale)")
    ax.set_title("Programming N identities: legacy script vs kube-proxy style vs natgw-agent")
    ax.grid(True, which="major", alpha=0.4)
    ax.grid(True, which="minor", axis="y", alpha=0.12)
    handles = [Line2D([], [], color=colors[k], linewidth=2, marker="o", label=names[k]) for k in names]
    handles += [Line2D([], [], color="black", linewidth=2, label="stateless"),
                Line2D([], [], color="black", linewidth=2, linestyle="--", label=f"ClientIP ({TIMEOUT} s)")]
    if res["legacy_extrapolated"]:
        handles.append(Line2D([], [], color=colors["legacy"], linestyle=":", marker="o", markerfacecolor="white",
                              label="legacy, extrapolated (not measured)"))
    ax.legend(handles=handles, fontsize=8.5, loc="upper left", framealpha=0.9)
    fig.tight_layout()
    _place_labels(fig, ax, labels)
    fig.savefig(path)
    plt.close(fig)


def _short(x: float) -> str:
    return f"{x:.0f} s" if x >= 100 else fmt_s(x)


def _place_labels(fig: Any, ax: Any, labels: list[tuple[float, float, str, str]]) -> None:
    """Value labels right of the last points, pushed apart vertically so none overlap."""
    fig.canvas.draw()
    gap = 11.0  # pixels between label baselines
    by_x: dict[float, list[tuple[float, float, str, str]]] = {}
    for label in labels:
        by_x.setdefault(label[0], []).append(label)
    for x, group in by_x.items():
        group.sort(key=lambda g: g[1])
        placed: list[float] = []
        for _, y, text, color in group:
            py = ax.transData.transform((x, y))[1]
            want = py if not placed else max(py, placed[-1] + gap)
            placed.append(want)
            ax.annotate(text, (x, y), xytext=(9, want - py - 3), textcoords="offset pixels", fontsize=8, color=color)


def markdown(res: dict[str, Any]) -> str:
    m, cfg = res["machine"], res["config"]
    dp_lo, dp_hi = cfg["dp_sizes"][0], cfg["dp_sizes"][-1]
    lines = [
        "# natgw-agent benchmarks",
        "",
        f"Generated by `python -m bench.run{' --quick' if cfg['mode'] == 'quick' else ''}` on "
        f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} ({cfg['mode']} mode, {res['runtime_s']:.0f} s).",
        "",
        f"**Machine:** {m['nproc']} CPUs ({m['cpu']}), kernel {m['kernel']}, {m['nft']}, Python {m['python']}, "
        f"{m['iptables_legacy']} and {m['iptables_nft']} (`iptables` here is {m['iptables_default']}). "
        f"1-minute load average at start / end of the run: {res.get('loadavg_start', float('nan')):.2f} / "
        f"{res.get('loadavg_end', float('nan')):.2f} (the benchmark itself keeps about one CPU busy).",
        "",
        "## Method",
        "",
        f"All approaches program the same identities: identity *i* is `172.18.x.y:(1000 + i mod 100)/tcp` "
        f"(100 ports per EIP, so 10,000 identities use 100 EIPs) with {BACKENDS} distinct backends `10.1.x.y:8080`; "
        f"ClientIP runs give every identity a {TIMEOUT} s timeout. Every case runs in a network namespace created "
        "for it and deleted after it; nothing touches the root namespace. Before each timed sync case the benchmark "
        f"waits (up to {res.get('config', {}).get('settle_max', 20):.0f} s) until the CPUs are below 15% busy over half "
        "a second: the kernel frees a deleted namespace's tables in a work queue after `ip netns del` returns, and "
        "that must not run while the next case is timed.",
        "",
        "- **legacy**: the legacy script's way (kube-ovn's nat-gateway.sh), from its description: one `nft -f -` process per "
        "identity with what `nft-dnat-map-add` sends for it: table, base chain and `service-ips` map declared idempotently, "
        "the base chain flushed and its vmap rule re-added, the identity's `dnat-<h>` chain emptied and refilled with an "
        "inline `numgen random mod N map { }` dnat, its map element; ClientIP adds per backend a timeout set `aff-<h>-<b>` "
        "and a chain `ep-<h>-<b>` (update, dnat) and a `numgen ... vmap` (h = md5(\"eip:port:proto\")[:12], "
        "b = md5(\"ip:port\")[:8]). The processes run one after another from a child process inside the namespace, "
        "each timed with `perf_counter` around its subprocess call; the time is their sum. The pods/exec round trip "
        "of the real controller is not included.",
        "- **kube-proxy style**: one `nft -f -` batch, one process: per identity a `service-<h>` chain with an inline "
        "`numgen random mod N vmap { }` to per-backend `endpoint-<h>-<b>` chains that dnat; ClientIP adds a timeout set per "
        "endpoint, an `ip saddr @affinity-...` check per endpoint in the service chain and an `update` in the endpoint chain "
        "(kube-proxy's nftables mode). A change flushes and refills that service's chain in one batch (new endpoint chain added, "
        "old one flushed); the old chain (and set) is deleted by a second batch a second later, timed separately.",
        "- **agent**: its real code path, in a child process inside the namespace: `DirectorySource(dir).poll()` on "
        f"manifests written as JSON `kind: List` files ({RULES_PER_FILE_IDENTITIES:,} identities = "
        f"{RULES_PER_FILE_IDENTITIES * BACKENDS:,} rules per file, plus `eips.json`), then "
        "`connected(Settings(gateway=\"gw1\", conntrack=False)).sync(src.objects())` (agent/run/daemon.py: the reconciler as `run` wires it) from an empty "
        "table, timed with `perf_counter` (the parse is timed and reported separately; \"of which libnftables\" is the time "
        "inside the Nft contexts' `json_cmd` and `cmd` calls, JSON encoding included). Then a no-op sync, one "
        "identity's change (its rules file rewritten "
        "atomically with one rule's `internalIp` changed, `poll()` twice since the source reads a changed file once it "
        "held still for one poll, then `sync`), `python -m agent.cli show` as a subprocess, and the peak RSS "
        "(`ru_maxrss`) of the driver process.",
        "- **One change**: identity N/2's last backend is replaced by another address, with N identities present.",
        f"- **Data plane**: per case a client, a gateway and a backend namespace (veth pairs, `ip_forward=1` in the "
        "gateway; the backend namespace holds 10.0.0.0/8 as local and one TCP server on :8080 that answers with the address "
        "it was reached at, so each answer names the backend the gateway chose). The gateway holds either the agent's "
        "table (programmed by the agent's code as above) or an iptables linear DNAT chain, the exclusive path: one "
        "`-t nat -A PREROUTING -d EIP -p tcp --dport P -j DNAT --to-destination B` per identity, loaded with "
        "`iptables-legacy-restore` (the baseline) and, for comparison, with `iptables-nft-restore`. The target identity is "
        f"the last one, whose iptables rule is the last of the chain (worst case). {cfg['dp_runs']} runs per case, "
        "interleaved across cases; each run is a child process in the client namespace making "
        f"{cfg['dp_connections']:,} sequential TCP connections (after {cfg['dp_warmup']} warm-up ones), each from its own "
        "never-reused source port, so every SYN is a new conntrack entry that crosses the NAT rules. Per-connection time "
        "is the `connect()` duration (the SYN through the gateway's rules, the SYN/ACK back): NAT rules see only a "
        "connection's first packet. (The whole exchange, connect to the answer's EOF, is kept in the raw results only: it "
        "mostly measures when the one-threaded server gets a CPU.) Reported: the median of the run medians, the min-max of the run medians, and "
        "the interquartile range of all connections pooled. Every answer was checked to come from one of the identity's "
        "backends.",
        "- **Checks** (not timed): after each full sync the kernel's table is counted (map elements, chains, and where "
        "listing is affordable named sets and rules) against what the approach must hold; after each change the "
        "identity's chain (or the agent's maps, read back) must lead to the new backend and not the old one (where "
        "listing even one chain is unaffordable, because nft 1.0.6 then fetches the elements of every set, the kernel is "
        "asked instead: deleting the new endpoint chain must be refused as busy, deleting the old one must succeed); the agent's "
        "no-op sync must send 0 commands and `show` must list every identity and backend.",
        "",
        "## Full sync: N identities from an empty table",
        "",
        "### Stateless",
        "",
        *sync_table(res, False),
        "",
        f"### ClientIP (timeout {TIMEOUT} s)",
        "",
        *sync_table(res, True),
        "",
        "![full sync times](benchmarks-sync.png)",
        "",
    ]
    if res["legacy_extrapolated"]:
        lines += [
            "Legacy sizes marked *extrapolated* were not measured (they would take longer than the whole benchmark's "
            "budget): the per-identity process times of the largest measured run were fitted as *t(i) = a + b·i* "
            "(*i* = identities already present; the first tenth left out as warm-up) and summed to N. "
            "The plot shows them as hollow markers on a dotted line.",
            "",
        ]
    fits = [r for r in res["legacy"] if r.get("half_fit_check")]
    if fits:
        lines += ["How far to trust the fit: fitted on the first half of a measured run only, it predicts the whole run: " + "; ".join(
            f"{r['n']:,} {'ClientIP' if r['affinity'] else 'stateless'}: predicted {fmt_s(r['half_fit_check']['predicted'])}, "
            f"measured {fmt_s(r['seconds'])}" for r in fits)
            + ". The per-process times are noisy (other processes share the 2 CPUs), so read the extrapolations as "
            "rough orders of magnitude. They are also a lower bound for the real script: it runs bash, computes its md5 "
            "hashes and is reached through pods/exec per rule (measured before in a gateway pod: ~37 ms per identity); here each "
            "identity costs only its `nft -f` process.", ""]
    per = [r for r in res["legacy"]]
    if per:
        lines += ["Legacy per-identity process time, first tenth vs last tenth of each run: " + "; ".join(
            f"{r['n']:,} {'ClientIP' if r['affinity'] else 'stateless'}: {r['per_identity_first_ms']:.1f} -> "
            f"{r['per_identity_last_ms']:.1f} ms" for r in per) + ".", ""]
    lines += [
        *lazy_imports(res),
        "## One identity's backend change",
        "",
        *change_table(res),
        "",
    ]
    lc = [c for c in res["changes"]]
    if lc:
        lines += ["For the legacy change with " + ", ".join(f"{c['present']:,}" for c in lc) + " present, the table was "
                  "first loaded the way the script leaves it, in one batch (" + ", ".join(fmt_s(c["setup_s"]) for c in lc)
                  + "), since adding them one process at a time would take too long; only the change's own process is timed.",
                  ""]
    lines += [
        "The legacy script, as described, does not delete the replaced backend's `ep-` chain and `aff-` set on an add "
        "(only on an identity's deletion), so they stay behind; the kube-proxy style and the agent remove theirs.",
        "",
        "## Agent details",
        "",
        *agent_table(res),
        "",
        "`sync(src.objects())` is the call the benchmark was asked to time: it evaluates every object. The run loop "
        "(`agent.run.loop`) calls `sync(source, source.take_changes())`, which evaluates only the objects the "
        "source saw change; the run loop's changes go that way, and its figure is the median of "
        f"{LOOP_CHANGES + 1} (identity N/2+1, then {LOOP_CHANGES} others, one at a time). Each change rewrites "
        f"one rules file, i.e. {RULES_PER_FILE_IDENTITIES * BACKENDS:,} rules (fewer at small sizes). "
        "\"the two polls\" is the directory source re-reading the rewritten file (the first poll sees it change, the "
        "second reads it). Peak RSS is the driver process's, which holds the parsed manifests, the model and the "
        "mirror of the table (`VmHWM`; `ru_maxrss` is not used because Linux carries the RSS of the forking "
        "parent across exec into it).",
        "",
        "## Data plane: cost of a new connection",
        "",
        *dataplane_tables(res),
        "",
        f"The agent's lookup is a hash of `daddr . l4proto . dport` in one verdict map, so a connection costs the same with "
        f"{dp_lo:,} or {dp_hi:,} identities; the iptables chain is walked rule by rule until the target's rule, the last one.",
        "",
        *choice_report.markdown(res["choice"]),
        "## Correctness checks made during this run",
        "",
        *checks(res),
        "",
    ]
    return "\n".join(lines)


def write(res: dict[str, Any], out: Path) -> dict[str, Path]:
    """The files; the sections bench.run does not measure, already in BENCHMARKS.md, are
    kept: busy neighbour and cleanup (`python -m bench.report --busy/--cleanup`), footprint
    (`python -m bench.footprint_report`), health checks (`python -m bench.checks_report`)."""
    md, png = out / "BENCHMARKS.md", out / "benchmarks-sync.png"
    plot(res, png)
    text = md.read_text(encoding="utf-8") if md.exists() else ""
    kept = [s for s in (section_of(text, h) for h in (FOOTPRINT_HEADING, CHECKS_HEADING, BUSY_HEADING, CLEANUP_HEADING))
            if s]
    md.write_text(markdown(res) + "".join(f"\n{s.rstrip()}\n" for s in kept), encoding="utf-8")
    return {"markdown": md, "plot": png}


# --- splicing the other benchmarks' sections into the file ---------------------------------

BUSY_HEADING = "## Busy neighbour"  # bench/busy_report.py's
CLEANUP_HEADING = "## Cleanup"  # bench/cleanup_report.py's
FOOTPRINT_HEADING = "## Footprint and reaction"  # bench/footprint_report.py's
CHECKS_HEADING = "## Health checks at scale"  # bench/checks_report.py's
_GENERATED_RE = re.compile(r"Generated by `python -m bench\.run[^`]*` on (\d{4}-\d\d-\d\d \d\d:\d\d) UTC")


def section_of(md: str, heading: str) -> str:
    """A section of a BENCHMARKS.md ("" if none): its heading up to the next level-2
    heading or the end."""
    start = md.find(f"\n{heading}\n")
    if start < 0:
        return ""
    end = md.find("\n## ", start + 1)
    return md[start + 1:end + 1 if end >= 0 else len(md)]


def splice_section(md: str, heading: str, section: str) -> str:
    """md with its section under `heading` replaced by `section` (appended if none)."""
    old = section_of(md, heading)
    if old:
        return md.replace(old, section + ("\n" if old.endswith("\n\n") else ""), 1)
    return md.rstrip("\n") + "\n\n" + section


def busy_section_of(md: str) -> str:
    """The busy neighbour section of a BENCHMARKS.md ("" if none)."""
    return section_of(md, BUSY_HEADING)


def splice_busy(md: str, section: str) -> str:
    """md with its busy neighbour section replaced by `section` (appended if none)."""
    return splice_section(md, BUSY_HEADING, section)


def parse_utc(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%d %H:%M").replace(tzinfo=timezone.utc)



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busy", type=Path, nargs="+", help="bench.busy's JSON results, one per system")
    p.add_argument("--cleanup", type=Path, help="bench.cleanup's JSON result")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "BENCHMARKS.md")
    args = p.parse_args(argv)
    # Imported here: each section's module imports this one for the splicing and formats.
    from bench.busy_report import busy_markdown
    from bench.cleanup_report import cleanup_markdown

    if not args.busy and not args.cleanup:
        p.error("which section? --busy and/or --cleanup")
    md = args.out.read_text(encoding="utf-8") if args.out.exists() else "# natgw-agent benchmarks\n"
    generated = _GENERATED_RE.search(md)
    rc = 0
    if args.busy:
        runs = []
        for path in args.busy:
            if path.exists():
                runs.append(json.loads(path.read_text()))
            else:
                print(f"bench.report: {path} missing (that run failed?): left out", file=sys.stderr)
        if runs:
            md = splice_busy(md, busy_markdown(runs, generated[1] if generated else None))
            print(f"bench.report: busy neighbour section ({len(runs)} systems) written to {args.out}")
        else:
            print("bench.report: no busy neighbour results", file=sys.stderr)
            rc = 1
    if args.cleanup:
        if args.cleanup.exists():
            res = json.loads(args.cleanup.read_text())
            md = splice_section(md, CLEANUP_HEADING, cleanup_markdown(res, generated[1] if generated else None))
            print(f"bench.report: cleanup section written to {args.out}")
        else:
            print(f"bench.report: {args.cleanup} missing (that run failed?)", file=sys.stderr)
            rc = 1
    args.out.write_text(md, encoding="utf-8")
    return rc


if __name__ == "__main__":
    sys.exit(main())
