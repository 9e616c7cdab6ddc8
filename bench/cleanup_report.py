"""The cleanup section of BENCHMARKS.md, from bench.cleanup's results; written by
`python -m bench.report --cleanup C.json`."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from bench.report import CLEANUP_HEADING, fmt_ratio, fmt_s, parse_utc

DECODERS = {
    "ctnetlink": "agent/kernel/ctnetlink.py: `Conntrack.flows(Query(eip, udp))`",
    "pyroute2_entries": "pyroute2: `Conntrack().dump_entries()`, destination and protocol compared in Python",
    "pyroute2_messages": "pyroute2: `NFCTSocket().dump()`, destination and protocol read with `get_nested` in Python",
}


def _code_of(v: dict[str, Any], res: dict[str, Any]) -> str:
    if v["label"].startswith("this tree"):
        changed = [f for f in res["code"]["changed"] if f.startswith("agent")]
        return f"commit {v['commit']}" + (f" with uncommitted changes to {', '.join(changed)}" if changed else "")
    return f"commit {v['commit']}"


def _cleaned_cell(v: dict[str, Any]) -> str:
    c = v["agent_log"]["cleaned_removal"]
    if c is None:
        sync = v["agent_log"]["removal_sync"] or {}
        if "flows_deleted" in sync:
            return f"no such line: the removal's sync deleted {sync['flows_deleted']:,} flows itself"
        return "not logged"
    return (f"{c['deleted']:,} deleted of {c['seen']:,} seen, {fmt_s(c['seconds'])}"
            f"{', kernel-filtered dump' if c.get('kernel_filtered') else ''} ✓")


def _sync_cell(v: dict[str, Any], which: str) -> str:
    log = v["agent_log"]
    sync, logged = log[f"{which}_sync"], log[f"{which}_sync_logged_s"]
    if sync is None:
        return "not logged"
    parts = [f"{sync.get('commands')} commands"]
    if "seconds" in sync:
        parts.append(f"took {fmt_s(sync['seconds'])}, waited {fmt_s(sync.get('waited'))}")
    parts.append(f"logged {fmt_s(logged)} after its file was written")
    if which == "change" and log["change_in_removal_sync"]:
        parts.append("the same sync as the removal")
    return ", ".join(parts)


def cleanup_table(res: dict[str, Any]) -> list[str]:
    vs = res["versions"]
    n = res["n"]

    def met(v: dict[str, Any], key: str, text: str) -> str:
        return f"{text} ✓" if v["targets"][key]["met"] else f"{text} **✗ missed**"

    def ratio(key: str) -> str:
        if len(vs) < 2:
            return ""
        vals = [v["targets"][key]["value"] for v in vs]
        return f" {fmt_ratio(vals[0], vals[-1])} |"

    limit = vs[0]["targets"]["change_in_kernel"]["target"]
    rows = [
        (f"every flow of the {n:,} removed identities gone from conntrack, from the removal written", "completes",
         lambda v: met(v, "cleanup_completes", fmt_s(v["removal"]["flows_gone_s"])), ratio("cleanup_completes")),
        (f"the other identity's change in the kernel, from its file written ({fmt_s(res['gap_s'])} after the removal)",
         f"≤ {limit * 1e3:g} ms", lambda v: met(v, "change_in_kernel", fmt_s(v["change"]["in_kernel_s"])),
         ratio("change_in_kernel")),
        ("the agent's log: the removal's sync", "-", lambda v: _sync_cell(v, "removal"), " |" if len(vs) > 1 else ""),
        ("the agent's log: the change's sync", "-", lambda v: _sync_cell(v, "change"), " |" if len(vs) > 1 else ""),
        ("the agent's log: `conntrack cleaned` for the removal", "reported (count, time)", _cleaned_cell, " |" if len(vs) > 1 else ""),
        ("before the removal: flows toward the identities (NATed to the backend); datagrams answered", "-",
         lambda v: f"{v['flows_before']['total']:,} ({v['flows_before']['natted']:,}); "
                   f"{v['traffic']['answered']:,} of {v['traffic']['ports']:,}", " |" if len(vs) > 1 else ""),
    ]
    head = "| measurement | target | " + " | ".join(f"{v['label']}" for v in vs) + " |"
    rule = "|---|---|" + "---:|" * len(vs)
    if len(vs) > 1:
        head += f" {vs[0]['label'].split(' ')[0]} / {vs[-1]['label'].split(' (')[0]} |"
        rule += "---:|"
    return [head, rule, *(f"| {name} | {target} | " + " | ".join(cell(v) for v in vs) + " |" + extra
                          for name, target, cell, extra in rows)]


def decode_table(res: dict[str, Any]) -> list[str]:
    d = res["decode"]
    base = d["decoders"]["ctnetlink"]["median_s"]
    lines = ["| decoder | time (median) | entries/s | time / agent/kernel/ctnetlink.py's |", "|---|---:|---:|---:|"]
    for name, r in d["decoders"].items():
        lines.append(f"| {DECODERS.get(name, name)} | {fmt_s(r['median_s'])} | {r['entries_per_s']:,.0f} | "
                     f"{fmt_ratio(r['median_s'], base)} |")
    return lines


def cleanup_markdown(res: dict[str, Any], rest_generated: str | None = None) -> str:
    """The section from bench.cleanup's results (`rest_generated`: as busy_markdown's)."""
    m, vs = res["machine"], res["versions"]
    n, d = res["n"], res["decode"]
    failed = [k for k, ok in res["checks"].items() if not ok]
    codes = "; ".join(f"{v['label'].split(' (')[0]}: {_code_of(v, res)}" for v in vs)
    lines = [
        CLEANUP_HEADING,
        "",
        f"The removal of {n:,} UDP identities on one EIP, each carrying a real NATed conntrack flow, and another "
        f"identity's change (a second backend) written {fmt_s(res['gap_s'])} later; the code before the cleanup thread "
        "(one `conntrack -D` process per removed identity, inside the sync) and this tree's (conntrack reconciled "
        "over netlink in a thread of its own), side by side in one run of `python -m bench.cleanup"
        + (f" --baseline {vs[0]['commit']}" if len(vs) > 1 else "") + f"` ({codes}). Started {res['started']}, "
        f"{res['runtime_s']:.0f} s, 1-minute load average {res['loadavg_start']:.2f} / {res['loadavg_end']:.2f} at "
        f"start / end; {m['nproc']} CPUs ({m['cpu']}), kernel {m['kernel']}, {m['nft']}, Python {m['python']}.",
        "",
        *cleanup_table(res),
        "",
        f"Decoding a conntrack dump of {d['m']:,} entries (all UDP toward the EIP, NATed to a backend, so the "
        f"kernel's filter passes every one and each decoder decodes them all; median of {d['reps']}, interleaved, "
        "the socket's creation included):",
        "",
        *decode_table(res),
        "",
        "How it was measured: each version runs in a fresh lab (lab/topology.py: client, gateway, two backends) as its "
        "own process in the gateway namespace (`python -m agent.cli --log-format json run --from-dir DIR`; the older "
        "code unpacked aside with `git archive` and run from there), with the identities on ports 20000 and up to "
        "b1:5353 and the other identity TCP 80 to b1:8080. The gateway's UDP conntrack timeouts are raised to "
        f"{res['udp_timeout']} s, so no flow expires on its own meanwhile. From the client namespace one datagram to "
        "each port from one socket, each answered by the backend: a NATed entry per identity, counted with "
        "`conntrack -L` before the removal. The removal rewrites the identities' rules file empty; the change "
        "rewrites the other identity's file. A probe in the gateway namespace (bench/cleanup_probe.py) polls every "
        "~5 ms: the flows are gone when the namespace's conntrack count (`nf_conntrack_count`) is back to what it "
        "held besides them (and `conntrack -L` finds none once the probe is done), the change is in the kernel when the other "
        "identity's element in a backend map, asked over netlink by its key, leads to b2. Times run from the file "
        "written (its rename returned) to the end of the first poll that found it; the agent's log lines are its "
        "own account (the older code logs no `seconds` or `waited` on a sync). Decoding: `conntrack -R` loads "
        "the entries into a fresh namespace; each decoder runs in a process there "
        "(`python -m bench.cleanup_probe decode`).",
        "",
        (f"Checks made (not times): all {len(res['checks'])} passed." if not failed
         else "Checks made (not times): FAILED: " + "; ".join(failed) + "."),
    ]
    if rest_generated is not None:
        started, rest = parse_utc(res["started"].removesuffix(" UTC")), parse_utc(rest_generated)
        if not timedelta(0) <= started - rest <= timedelta(hours=2):
            lines += ["", "This section was added to the file by `python -m bench.report --cleanup` from "
                          "bench.cleanup's results without running `make bench` again: the `bench.run` sections above "
                          f"are from its run of {rest_generated} UTC and the busy neighbour section from its own runs; "
                          "none was rerun."]
    return "\n".join(lines) + "\n"
