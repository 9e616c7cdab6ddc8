"""The consistent choice section of BENCHMARKS.md and its checks, from bench.choice's
results (written by bench/report.py with the rest of bench.run's sections)."""
from __future__ import annotations

from typing import Any

from bench import ipvs_mh

HEADING = "## Consistent choice: the agent's table beside IPVS `mh`"


def _points(x: float) -> str:
    return f"{x * 100:.1f}"


def _three(s: dict[str, float]) -> str:
    return f"{_points(s['mean'])} / {_points(s['p95'])} / {_points(s['worst'])}"


def markdown(res: dict[str, Any]) -> list[str]:
    cfg = res["config"]
    counts = cfg["counts"]
    schemes = res["schemes"]
    lines = [
        HEADING,
        "",
        f"Which backend a client with no pin reaches, for N = {counts[0]}..{counts[-1]} backends: {cfg['sets']} random "
        f"backend sets per N, each added in a random order, and {cfg['clients']:,} distinct random client addresses "
        f"(seeds {cfg['seed']} and {cfg['seed'] + 1}); pure computation, {res['cpu_s']:.0f} s of CPU. The agent: "
        "`jhash ip saddr mod M` into its rendezvous table (agent/core/consistent.py, a bit-exact model of the "
        "kernel's side, checked against the kernel's own choices by netns-tests/test_jhash_kernel.py). IPVS `mh`: "
        "this machine's kernel has no IPVS, so its side is a model of net/netfilter/ipvs/ip_vs_mh.c (bench/ipvs_mh.py: "
        "hsiphash checked against the kernel's published vectors, the offset/skip permutations, the populate loop, "
        f"the lookup), source address only, all weights equal. Its table size is one compile-time prime: "
        f"{ipvs_mh.TAB_SIZE:,} by default, {ipvs_mh.PRIMES[0]} at the smallest, so 61 is shown with Maglev's "
        "construction only.",
        "",
        "All figures are points (percent of the clients). *Balance*: the worst |share - 1/N| of any backend. "
        "*Removing one*: each backend of each set in turn, the share of clients whose backend changes (mean / p95 / "
        "worst); *beyond 1/N*: that less 1/N, the removed backend's expected share; *others moved*: the clients of the "
        "backends that stayed whose backend changed anyway. *Adding one*: likewise, beyond 1/(N+1). *Order*: the same "
        "set added in another order, the share of clients whose backend differs (mean / worst). Both tables give "
        "each backend M/N entries rounded down or up, so *balance* is how the clients spread over the buckets.",
        "",
        "| table | balance: worst | removing one: moved | beyond 1/N | others moved | adding one: moved "
        "| beyond 1/(N+1) | order |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in schemes:
        lines.append(f"| {s['label']} | {_points(s['balance_worst'])} | {_three(s['remove'])} "
                     f"| {_three(s['remove_beyond'])} | {_three(s['remove_others'])} | {_three(s['add'])} "
                     f"| {_three(s['add_beyond'])} | {_points(s['order']['mean'])} / {_points(s['order']['worst'])} |")
    lines += [
        "",
        "Removing one of N, the worst points moved beyond 1/N, per N:",
        "",
        "| table | " + " | ".join(f"N = {n}" for n in counts) + " |",
        "|---|" + "---:|" * len(counts),
    ]
    for s in schemes:
        lines.append(f"| {s['label']} | " + " | ".join(_points(x) for x in s["remove_beyond_worst_by_n"]) + " |")
    lines += [
        "",
        "What the kernel's construction implies (read in ip_vs_mh.c and ip_vs_ctl.c): its hash keys are fixed "
        "constants (`generate_hash_secret`), the same for every service on every machine, so two directors build "
        "the same table from the same list of reals; the list is newest first (`list_add_rcu`), the order the "
        "reals were added, which replicas restarted or programmed at different times need not share, and the "
        "*order* column is what that costs. A real is hashed as one number, address + port (10.0.0.1:8080 and "
        "10.0.0.2:8079 get the same permutation). Two reals with the same skip share one preference cycle, and "
        "the list order decides which of them takes each of its entries: the smaller the table, the likelier "
        "(8 reals at 251: about one set in ten).",
        "",
    ]
    return lines


def checks(res: dict[str, Any]) -> list[tuple[bool, str]]:
    """What must hold whatever the numbers, as (ok, what) for bench.report's checks."""
    found = []
    for s in res["schemes"]:
        least = s["remove_others_least"]
        found.append((least >= 0, f"choice {s['key']}: removing a backend moved all its own clients "
                                  f"(others moved at least {least * 100:.2f} points)"))
        if s["key"].startswith("agent"):
            worst = s["order"]["worst"]
            found.append((worst == 0, f"choice {s['key']}: the table ignores the order backends came "
                                      f"({worst * 100:.2f} points differ at worst)"))
    return found
