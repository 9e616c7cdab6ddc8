"""The consistent choice beside its anchor (issue 21): the agent's table
(agent/core/consistent.py: `jhash ip saddr mod M` into a rendezvous table, M = 61) against
IPVS's `mh` scheduler as the kernel builds it (bench/ipvs_mh.py; this machine's kernel has
no IPVS, so its side is the model). Pure CPU, no namespaces: bench.run calls `run` in both
modes; `python -m bench.choice [--quick]` prints the section alone.

For N = 2..8 backends, random backend sets (seeded), each added in a random order, and
distinct random client addresses (seeded), per table:
  balance   the worst |share - 1/N| of the clients, over every backend of every set
  removing  each backend of the set in turn: the share of clients whose backend changes
            (at least the removed backend's own share, about 1/N), and that less 1/N
  adding    one backend more: the share moved, and that less 1/(N+1)
  order     the same set added in another random order: the share of clients whose
            backend differs (IPVS builds from its list of reals, newest first; the
            agent from the set, so 0)
The sizes: the agent's 61 and the kernel's default 4093; for like-for-like views, the
smallest table the kernel allows (251) for both, and the Maglev construction at 61 (a size
the kernel cannot be built with)."""
from __future__ import annotations

import argparse
import ipaddress
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from agent.core import consistent
from agent.core.model import Backend
from bench import ipvs_mh
from bench.choice_report import markdown


@dataclass(frozen=True)
class Config:
    counts: tuple[int, ...] = tuple(range(2, 9))  # N, the backends of a set
    sets: int = 100  # random backend sets per N
    clients: int = 10_000
    seed: int = 21


# The full comparison: 13 s of CPU here, 7 of them for IPVS's tables of 4093 entries
# (5,600, about 1.3 ms each with its comparison) and 3.6 for the agent's of 251. Quick: 1 s.
FULL = Config()
QUICK = Config(sets=8, clients=2_000)


@dataclass(frozen=True)
class Scheme:
    key: str
    label: str
    size: int
    build: Callable[[Sequence[Backend]], tuple[Any, ...]]  # the kernel's list order in, table out
    position: Callable[[str, int], int]  # a client's bucket in a table of this size


def _mh_position(client: str, size: int) -> int:
    return ipvs_mh.hashkey(client, 0, ipvs_mh.HASH1) % size


def _agent(size: int, note: str) -> Scheme:
    return Scheme(f"agent-{size}", f"agent, M = {size}{note}", size,
                  lambda order: consistent.table(order, size), consistent.bucket)


def _mh(size: int, note: str) -> Scheme:
    return Scheme(f"mh-{size}", f"IPVS `mh`, M = {size}{note}", size,
                  lambda order: ipvs_mh.populate(order, size), _mh_position)


SCHEMES = (
    _agent(consistent.SIZE, " (what the agent ships)"),
    _mh(ipvs_mh.TAB_SIZE, " (the kernel's default)"),
    _mh(ipvs_mh.PRIMES[0], " (the kernel's smallest)"),
    _agent(ipvs_mh.PRIMES[0], " (like for like)"),
    _mh(consistent.SIZE, " (Maglev's construction; not a size the kernel allows)"),
)


@dataclass(frozen=True)
class Case:
    added: tuple[Backend, ...]  # the set, in the order it was added
    shuffled: tuple[Backend, ...]  # the same set, added in another order
    new: Backend  # the one added next


def backends_of(count: int, rng: random.Random) -> list[Backend]:
    """`count` distinct random backends (10.x.y.z on port 80, 8080 or 9090), in the order drawn."""
    found: dict[Backend, None] = {}
    while len(found) < count:
        found[Backend(f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}",
                      rng.choice((80, 8080, 9090)))] = None
    return list(found)


def cases(cfg: Config) -> dict[int, list[Case]]:
    """The backend sets per N, the same for every scheme."""
    rng = random.Random(cfg.seed)
    found: dict[int, list[Case]] = {}
    for n in cfg.counts:
        for _ in range(cfg.sets):
            members = backends_of(n + 1, rng)
            shuffled = members[:n]
            while n > 1 and shuffled == members[:n]:
                rng.shuffle(shuffled)
            found.setdefault(n, []).append(Case(tuple(members[:n]), tuple(shuffled), members[n]))
    return found


def clients(cfg: Config) -> list[str]:
    rng = random.Random(cfg.seed + 1)
    return [str(ipaddress.IPv4Address(a)) for a in rng.sample(range(1 << 32), cfg.clients)]


def moved(before: Sequence[Any], after: Sequence[Any], weights: Sequence[int]) -> int:
    """How many clients reach a different backend in `after` than in `before`."""
    return sum(w for a, b, w in zip(before, after, weights) if a != b)


def held(table: Sequence[Any], weights: Sequence[int]) -> dict[Any, int]:
    """How many clients each backend of a table has."""
    found: dict[Any, int] = {}
    for owner, weight in zip(table, weights):
        found[owner] = found.get(owner, 0) + weight
    return found


def spread(values: list[float]) -> dict[str, float]:
    """Mean, 95th percentile (nearest rank) and worst."""
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "p95": ordered[math.ceil(0.95 * len(ordered)) - 1],
            "worst": ordered[-1]}


def measure(scheme: Scheme, sets: dict[int, list[Case]], addresses: list[str]) -> dict[str, Any]:
    start = time.process_time()
    weights = [0] * scheme.size
    for client in addresses:
        weights[scheme.position(client, scheme.size)] += 1
    total = len(addresses)
    balance: list[float] = []
    removed: list[float] = []
    removed_beyond: list[float] = []
    others: list[float] = []  # moved, less the removed backend's own clients: never below 0
    added: list[float] = []
    added_beyond: list[float] = []
    order: list[float] = []
    worst_by_n: list[float] = []
    for n, group in sets.items():
        worst = -1.0
        for case in group:
            kernel_list = ipvs_mh.list_order(case.added)
            before = scheme.build(kernel_list)
            shares = held(before, weights)
            balance += [abs(shares.get(b, 0) / total - 1 / n) for b in case.added]
            for gone in case.added:
                count = moved(before, scheme.build([b for b in kernel_list if b != gone]), weights)
                removed.append(count / total)
                removed_beyond.append(count / total - 1 / n)
                others.append((count - shares.get(gone, 0)) / total)
                worst = max(worst, removed_beyond[-1])
            count = moved(before, scheme.build(ipvs_mh.list_order((*case.added, case.new))), weights)
            added.append(count / total)
            added_beyond.append(count / total - 1 / (n + 1))
            order.append(moved(before, scheme.build(ipvs_mh.list_order(case.shuffled)), weights) / total)
        worst_by_n.append(worst)
    return {"key": scheme.key, "label": scheme.label, "size": scheme.size,
            "balance_worst": max(balance), "balance_mean": statistics.fmean(balance),
            "remove": spread(removed), "remove_beyond": spread(removed_beyond),
            "remove_others": spread(others), "remove_others_least": min(others),
            "remove_beyond_worst_by_n": worst_by_n,
            "add": spread(added), "add_beyond": spread(added_beyond),
            "order": {"mean": statistics.fmean(order), "worst": max(order)}, "cpu_s": time.process_time() - start}


def run(cfg: Config = FULL, log: Callable[[str], Any] = print) -> dict[str, Any]:
    start = time.process_time()
    sets, addresses = cases(cfg), clients(cfg)
    log(f"consistent choice: the agent's table and IPVS mh, N = {cfg.counts[0]}..{cfg.counts[-1]}, "
        f"{cfg.sets} sets each, {cfg.clients:,} clients")
    schemes = [measure(s, sets, addresses) for s in SCHEMES]
    return {"config": asdict(cfg), "schemes": schemes, "cpu_s": time.process_time() - start}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.choice", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer sets and clients: a few seconds")
    args = p.parse_args(argv)
    res = run(QUICK if args.quick else FULL)
    print("\n".join(markdown(res)))
    print(f"\n({res['cpu_s']:.1f} s of CPU)")


if __name__ == "__main__":
    main()
