"""The agent's model of `jhash ip saddr mod M seed S` (tests/consistent.py) against the
kernel: in a namespace of its own (always deleted), a table records, per source address,
the value each hash rule put in the packet's mark; a child process inside the namespace
sends one raw UDP packet from each of 1,000 addresses; the model must predict every one.

`mod 4294967295` records almost the whole 32-bit hash (reciprocal_scale by 2^32 - 1 is
h - 1), which is what tests/fixtures/jhash-kernel.json holds for the unit tests: this test
checks the kernel still gives those values, and UPDATE_GOLDEN=1 records them anew.

The sets are declared `typeof ip saddr . meta mark`, never with `jhash` in a typeof (that
loads, but then `nft list ruleset` segfaults, nft 1.0.6 and 1.1.3: seen here)."""
from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from gwtest import fresh_namespace, ns_run
from agent.core.consistent import SEED, SIZE, bucket

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "jhash-kernel.json"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
WHOLE = 0xFFFFFFFF  # the largest modulus: the bucket is the hash, less one
TARGET = "10.99.0.2"  # a neighbour that never answers: the output hook is all we need
OTHER_SEED = 1
OFFSET = 1000

# Each recording rule: set name -> the hash expression that fills the mark.
HASHES = {
    "whole": f"jhash ip saddr mod {WHOLE} seed {SEED:#x}",
    "whole_other": f"jhash ip saddr mod {WHOLE} seed {OTHER_SEED}",
    "chosen": f"jhash ip saddr mod {SIZE} seed {SEED:#x}",
    "offset": f"jhash ip saddr mod {SIZE} seed {SEED:#x} offset {OFFSET}",
    "unseeded": f"jhash ip saddr mod {SIZE}",
}

SENDER = """
import json, socket, struct, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)  # IP_HDRINCL
target = socket.inet_aton(sys.argv[1])
for source in json.load(sys.stdin):
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28, 0, 0, 64, 17, 0, socket.inet_aton(source), target)
    sock.sendto(header + struct.pack("!HHHH", 40000, 9, 8, 0), (sys.argv[1], 0))
"""


def ruleset() -> str:
    sets = "".join(f"  set {name} {{ typeof ip saddr . meta mark; flags dynamic; size 65536; }}\n"
                   for name in HASHES)
    rules = "".join(f"    ip daddr {TARGET} meta mark set {expr}\n    ip daddr {TARGET} update @{name} "
                    f"{{ ip saddr . meta mark }}\n" for name, expr in HASHES.items())
    return (f"table ip jhtest {{\n{sets}  chain out {{\n    type filter hook output priority 0; policy accept;\n"
            f"{rules}  }}\n}}\n")


def addresses(count: int) -> list[str]:
    """Distinct unicast addresses spread over every byte (a fixed draw)."""
    rng = random.Random(21)
    found: dict[str, None] = {}
    while len(found) < count:
        first = rng.choice([n for n in range(1, 224) if n not in (10, 127)])
        found[f"{first}.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}"] = None
    return list(found)


@contextlib.contextmanager
def namespace() -> Iterator[str]:
    with fresh_namespace("ngwjh") as ns:
        for cmd in (["link", "set", "lo", "up"], ["link", "add", "jh0", "type", "veth", "peer", "name", "jh1"],
                    ["addr", "add", "10.99.0.1/24", "dev", "jh0"], ["link", "set", "jh0", "up"],
                    ["link", "set", "jh1", "up"],
                    ["neigh", "add", TARGET, "lladdr", "02:00:00:00:00:02", "dev", "jh0"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True)
        yield ns


@pytest.fixture(scope="module")
def recorded() -> Iterator[dict[str, dict[str, int]]]:
    """Per hash rule, what the kernel put in the mark for each source address sent."""
    fixture = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {"whole": {}}
    sent = list(dict.fromkeys([*addresses(1000), *fixture["whole"]]))
    with namespace() as ns:
        ns_run(ns, "nft", "-f", "-", stdin=ruleset())
        ns_run(ns, sys.executable, "-c", SENDER, TARGET, stdin=json.dumps(sent))
        assert "jhtest" in ns_run(ns, "nft", "list", "ruleset")  # lists (and does not crash)
        seen = {}
        for name in HASHES:
            listing = json.loads(ns_run(ns, "nft", "-j", "list", "set", "ip", "jhtest", name))
            [declared] = [obj["set"] for obj in listing["nftables"] if "set" in obj]
            seen[name] = {elem["concat"][0]: elem["concat"][1] for elem in declared.get("elem", [])}
            assert len(seen[name]) == len(sent), f"{name}: {len(seen[name])} of {len(sent)} packets recorded"
        yield seen


def test_the_model_predicts_the_kernels_bucket_for_1000_addresses(recorded: dict[str, dict[str, int]]) -> None:
    clients = addresses(1000)
    for name, seed, size, offset in (("whole", SEED, WHOLE, 0), ("whole_other", OTHER_SEED, WHOLE, 0),
                                     ("chosen", SEED, SIZE, 0), ("offset", SEED, SIZE, OFFSET)):
        wrong = {c: (recorded[name][c], bucket(c, size, seed, offset)) for c in clients
                 if recorded[name][c] != bucket(c, size, seed, offset)}
        assert not wrong, f"{name}: {len(wrong)} of 1000 mispredicted, e.g. {list(wrong.items())[:3]}"
    assert len(set(recorded["chosen"].values())) == SIZE  # every bucket was reached


def test_without_a_seed_the_kernel_does_not_follow_the_model(recorded: dict[str, dict[str, int]]) -> None:
    """The twin: a rule without `seed` gets a random one, so the model agrees by chance
    only (about 1 in SIZE)."""
    clients = addresses(1000)
    agree = sum(recorded["unseeded"][c] == bucket(c, SIZE, SEED) for c in clients)
    assert agree < 100, f"{agree} of 1000 agreed with the seeded model"
    assert len(set(recorded["unseeded"].values())) == SIZE  # the rule did run and spread


def test_the_unit_tests_fixture_is_the_kernels(recorded: dict[str, dict[str, int]]) -> None:
    clients = addresses(1000)[:64]
    current = {
        "kernel": os.uname().release,
        "modulus": WHOLE,
        "whole": {c: {str(SEED): recorded["whole"][c], str(OTHER_SEED): recorded["whole_other"][c]} for c in clients},
    }
    if UPDATE:
        FIXTURE.write_text(json.dumps(current, indent=1) + "\n")
    assert FIXTURE.exists(), f"{FIXTURE} missing: run with UPDATE_GOLDEN=1"
    stored = json.loads(FIXTURE.read_text())
    for client, by_seed in stored["whole"].items():
        for seed, value in by_seed.items():
            assert recorded["whole" if int(seed) == SEED else "whole_other"][client] == value, (client, seed)
