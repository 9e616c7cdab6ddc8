"""The busy neighbour section of BENCHMARKS.md, from bench.busy's results (one JSON file per
system); written by `python -m bench.report --busy A.json [B.json ...]`."""
from __future__ import annotations

import re
import statistics
from datetime import timedelta
from typing import Any

from bench.report import BUSY_HEADING, fmt_s, parse_utc


def _system(run: dict[str, Any]) -> str:
    m = run["machine"]
    os_name = re.sub(r"^Debian GNU/Linux (\d+).*", r"Debian \1", m.get("os", "unknown"))
    nft = re.search(r"v?(\d+\.\d+\.\d+)", m.get("nft", ""))
    py = ".".join(m.get("python", "?").split(".")[:2])
    return f"{os_name} (nft {nft[1] if nft else '?'}, Python {py})"


def _met(run: dict[str, Any], key: str, text: str) -> str:
    t = run["targets"][key]
    return f"{text} ✓" if t["met"] else f"{text} **✗ missed**"


def _target(key: str, runs: list[dict[str, Any]]) -> str:
    t = runs[0]["targets"][key]
    x = t["target"]
    if t["unit"] == "s":
        return f"≤ {x:g} s" if x >= 1 else f"≤ {x * 1e3:g} ms"
    return f"≤ {x:g}{t['unit']}"


def _repair_cell(run: dict[str, Any], name: str) -> str:
    r = run["repairs"][name]
    if not r["seconds"]:
        return "not repaired **✗ missed**"
    text = f"{fmt_s(r['median'])} / {fmt_s(r['max'])}"
    if not r["all_repaired"]:
        return f"{text}, {len(r['seconds'])} of {run['reps']} repaired **✗ missed**"
    ok = r["max"] <= run["targets"]["repair"]["target"]
    return f"{text} ✓" if ok else f"{text} **✗ missed**"


def _restart_checks(run: dict[str, Any]) -> str:
    r = run["restart"]
    lost = sum(len(v) for v in r["pins_lost"].values())
    parts = ["sent nothing" if r["sent_nothing"] else f"**sent {len(r['sent'])}+ log lines of changes**",
             "table unchanged" if r["table_unchanged"] else "**table changed**",
             f"{r['pins'] - lost} of {r['pins']} pins kept"]
    ok = r["sent_nothing"] and r["table_unchanged"] and r["pins_kept"]
    return ", ".join(parts) + (" ✓" if ok else " **✗ missed**")


def _command_cell(run: dict[str, Any], key: str) -> str:
    c = run["commands"][key]
    if c["rc"] != 0:
        return f"exit {c['rc']} **✗ missed**"
    return _met(run, key, fmt_s(c["seconds"]))


def busy_table(runs: list[dict[str, Any]]) -> list[str]:
    first = runs[0]
    reps, cpu_s = first["reps"], first["cpu_window_s"]
    rows: list[tuple[str, str, Any]] = [
        (f"agent CPU at rest beside the neighbour ({cpu_s:g} s)", _target("cpu_neighbour", runs),
         lambda r: _met(r, "cpu_neighbour", f"{r['cpu']['neighbour']['percent']:.1f}% of a core")),
        (f"agent CPU at rest, no neighbour ({cpu_s:g} s)", "-",
         lambda r: f"{r['cpu']['quiet']['percent']:.1f}% of a core"),
        *[(f"repair: {r_name} ({first['repairs'][r_name]['what']}); median / max of {reps}", f"each {_target('repair', runs)}",
           lambda r, r_name=r_name: _repair_cell(r, r_name)) for r_name in first["repairs"]],
        ("restart (SIGKILL) to ready on the status socket", _target("restart_ready", runs),
         lambda r: _met(r, "restart_ready", fmt_s(r["restart"]["ready_s"]))),
        ("the restarted agent: what it sent, pinned clients", "nothing sent, every pin kept", _restart_checks),
        ("`natgw-agent show`", _target("show", runs), lambda r: _command_cell(r, "show")),
        ("`natgw-agent show --json`", _target("show_json", runs), lambda r: _command_cell(r, "show_json")),
        ("`natgw-agent diff --gateway gw1 --from-dir DIR` (converged: exit 0, no output)", _target("diff", runs),
         lambda r: _command_cell(r, "diff")),
        (f"metrics scrape: first / later (median, max of {len(first['scrape']['later_s'])})", f"each {_target('scrape', runs)}",
         lambda r: _met(r, "scrape", f"{fmt_s(r['scrape']['first_s'])} / {fmt_s(r['scrape']['later_median_s'])}, "
                                     f"{fmt_s(r['scrape']['later_max_s'])} ({r['scrape']['later'][-1]['bytes'] / 1e6:.1f} MB, "
                                     f"{r['scrape']['later'][-1]['backend_series']:,} backend series)")),
        ("full read-back, quiet (`KernelView.read()`; median of "
         f"{len(first['readback']['runs'])} in brackets)", _target("readback", runs),
         lambda r: _met(r, "readback", f"{fmt_s(r['readback']['first_s'])} ({fmt_s(r['readback']['median'])})")),
        ("first start to ready (not a target: parse, read-back, full sync)", "-", lambda r: fmt_s(r["first_ready_s"])),
    ]
    lines = ["| measurement | target | " + " | ".join(_system(r) for r in runs) + " |",
             "|---|---|" + "---:|" * len(runs)]
    lines += [f"| {name} | {target} | " + " | ".join(cell(r) for r in runs) + " |" for name, target, cell in rows]
    return lines


def busy_markdown(runs: list[dict[str, Any]], rest_generated: str | None = None) -> str:
    """The section. `rest_generated`: when the file's bench.run sections were generated
    ("YYYY-MM-DD HH:MM"), to say whether they come from the same `make bench`."""
    first = runs[0]
    n, clients = first["n"], first["clients"]
    starts = "; ".join(f"{_system(r)}: {r['started']}, {r['runtime_s']:.0f} s, 1-minute load average "
                       f"{r['loadavg_start']:.2f} / {r['loadavg_end']:.2f} at start / end" for r in runs)
    failed = [f"{_system(r)}: {k}" for r in runs for k, ok in r["checks"].items() if not ok]
    commits = "; ".join(f"{_system(r)}: {r['neighbour'].get('commits')} commits, {r['neighbour'].get('failures')} failed"
                        for r in runs)
    ticks = 1e3 / first.get("clk_tck", 100)
    def code(r: dict[str, Any]) -> str:
        c = r.get("code") or {}
        dirty = f" with uncommitted changes to {', '.join(f'`{f}`' for f in c['changed'])}" if c.get("changed") else ""
        return f"commit {str(c.get('commit', 'unknown'))[:7]}{dirty}"
    codes = {code(r) for r in runs}
    measured = codes.pop() if len(codes) == 1 else "; ".join(f"{_system(r)}: {code(r)}" for r in runs)
    lines = [
        BUSY_HEADING,
        "",
        f"The agent at {n:,} identities x {first['backends']} backends plus one ClientIP identity, while another table "
        f"in its network namespace commits every {first['neighbour_interval_s'] * 1e3:.0f} ms (`python -m lab.neighbour`), "
        "on this machine and in the Debian 13 root (`images/debian13/root.sh`: the same kernel, that system's nftables "
        "and Python). Measured by `python -m bench.busy` on each; "
        f"started {starts}. The code measured: {measured}.",
        "",
        *busy_table(runs),
        "",
        "How it was measured: the agent runs as its own process (`python -m agent.cli run --from-dir DIR "
        "--no-health-checks`: nothing answers at its 40,000 backend addresses; the health checks section measures "
        "those) in a fresh "
        f"network namespace; the ClientIP identity's {clients} pinned clients are affinity entries added with "
        f"`nft add element` (no traffic), {clients // first['backends']} per slot. The neighbour commits throughout, except in the \"no neighbour\" "
        "CPU window and for the quiet read-back. CPU: the agent's utime + stime from `/proc/PID/stat` (all its "
        f"threads) over the window, at rest, as a share of one core (ticks of {ticks:g} ms: "
        f"{ticks / 10 / first['cpu_window_s']:.2g}% resolution). "
        "Repairs: each damage is one `nft -f -` transaction (the set: its two user chains flushed, then `aff_0` "
        "deleted); the time runs from `nft` returning until a probe process in the namespace, polling every ~10 ms "
        "over netlink with `agent.kernel.nftread` (declarations, chains and rules through `read_table(elements=False)`, "
        "~1-2 ms; the deleted element asked for by its key), finds the damaged part as before; a full `read_table` "
        "right after must equal the table before the damage (affinity entries and counters aside), and the agent "
        "must have logged the drift. Restart: SIGKILL, start again, until the status socket answers `ready`; 2 s "
        "later its log since `starting` must hold no `synced`, `transaction` or `drift` line, the table must equal "
        "the one before and every pinned client must still be in its affinity set. `show`, `show --json` and `diff` "
        "are `python -m agent.cli ...` run from the probe in the namespace (wall time, Python's start included). "
        "The damaging `nft` commands themselves took "
        + "; ".join(f"{_system(r)}: {fmt_s(statistics.median(x['nft_s'] for rep in r['repairs'].values() for x in rep['runs']))}"
                    for r in runs) + " (median). "
        "Scrapes: `GET /metrics` from the probe: the agent's first, then more from 2 s later, when the backend "
        "counters (read in the background after the first scrape asked) are in the answer. Read-back: "
        "`KernelView(\"ip\", \"natgw\").read()` in the probe. The neighbour: " + commits + ".",
        "",
        (f"Checks made (not times): all {sum(len(r['checks']) for r in runs)} passed." if not failed
         else "Checks made (not times): FAILED: " + "; ".join(failed) + "."),
    ]
    if rest_generated is not None:
        earliest = min(parse_utc(r["started"].removesuffix(" UTC")) for r in runs)
        rest = parse_utc(rest_generated)
        if not timedelta(0) <= earliest - rest <= timedelta(hours=2):
            lines += ["", f"This section was added to the file by `python -m bench.report --busy` from bench.busy's "
                          f"results without running `make bench` again: the sections above are from the `bench.run` of "
                          f"{rest_generated} UTC and were not rerun."]
    return "\n".join(lines) + "\n"


# --- the cleanup section (bench.cleanup) ----------------------------------------------------
