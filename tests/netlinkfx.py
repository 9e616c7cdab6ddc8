"""Recorded kernel answers for the netlink read-back's tests (tests/test_nftread*.py):
tests/fixtures/netlink/nft-<version>.json holds what the kernel answered for tables that
nft <version> wrote (recorded by tests/fixtures/netlink/record.py; re-record when the
table's layout changes): the agent's table programmed with examples/, the legacy
`ip kube-ovn` table, a table of rules beyond the agent's vocabulary, and notifications."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.oracles import render
from agent.core.ruleset import EMPTY, Ruleset
from agent.kernel import nfnetlink as nl
from agent.kernel import nftread
from agent.kernel.nftuapi import FAMILIES
from agent.settings import Settings
from agent.sources.directory import DirectorySource
from tests.oracles import build_inventory, desired_services

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_DIR = ROOT / "tests" / "fixtures" / "netlink"
FIXTURES = sorted(FIXTURE_DIR.glob("nft-*.json"))
NFT_106 = FIXTURE_DIR / "nft-1.0.6.json"
IP = FAMILIES["ip"]


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def messages(hexes: list[str]) -> list[nl.Message]:
    return [m for h in hexes for m in nl.split_messages(bytes.fromhex(h))]


def decoded(fx: dict[str, Any], key: str) -> nftread.TableState:
    t = fx["tables"][key]
    d = t["dumps"]
    return nftread.assemble(FAMILIES[t["family"]], t["table"], messages(d["sets"]),
                            {n: messages(v) for n, v in d["elements"].items()}, messages(d["chains"]),
                            messages(d["rules"]))


def rendered_examples() -> Ruleset:
    source = DirectorySource(ROOT / "examples")
    source.poll()
    s = Settings()
    services = desired_services(build_inventory(source.objects(), "gw1").rules, s.max_backends).services
    return render(services, EMPTY, s.affinity_set_size, s.priority)


def is_opaque(rule: dict[str, Any]) -> bool:
    return any("opaque" in e for e in rule["expr"] if isinstance(e, dict))
