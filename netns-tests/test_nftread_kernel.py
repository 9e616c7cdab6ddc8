"""The agent's own netlink read-back (agent/kernel/nftread.py) against the real kernel: it equals
what the agent renders (and, on nft 1.0.6, what libnftables lists), at 10,000 identities x 4
backends too, and it completes while another table commits every 100 ms (where a
libnftables listing of such a table never returns, measured here). Each case runs
netns-tests/scripts/nftread_kernel.py inside a namespace of its own (always deleted);
times are printed, not asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from gwtest import fresh_namespace

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "netns-tests" / "scripts" / "nftread_kernel.py"
SCALE = 10_000  # identities, 4 backends each: 50,000 map elements


def run_in(ns: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(SCRIPT), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print(args[0], json.dumps(report))
    return report


@pytest.fixture
def fresh_ns() -> Iterator[str]:
    with fresh_namespace("ngwrd") as ns:
        yield ns


@pytest.fixture(scope="module")
def scaled_ns() -> Iterator[str]:
    """A namespace holding the agent's table for SCALE identities x 4 backends."""
    with fresh_namespace("ngwrd10k") as ns:
        run_in(ns, "program", str(SCALE))
        yield ns


def check_nft_read(report: dict[str, Any]) -> None:
    """Equal to libnftables' listing where that listing is the canonical form (1.0.6);
    newer nft lists the same table differently (1.1.x: other forms of the same meaning)."""
    if report["nft_version"] == "1.0.6":
        assert report["equals_nft_read"], report["diff_nft_read"]


def test_the_examples_read_back_equal_libnftables_and_the_render(fresh_ns: str) -> None:
    report = run_in(fresh_ns, "examples")
    check_nft_read(report)
    assert report["equals_rendered"], report["diff_rendered"]
    assert report["absent_is_none"] and report["read_set_aff_0"] and report["read_set_missing"]


def test_ten_thousand_identities_read_back_whole(scaled_ns: str) -> None:
    report = run_in(scaled_ns, "quiet", str(SCALE))
    assert report["elements"] == SCALE * 5  # services + 4 backend maps
    check_nft_read(report)
    assert report["equals_rendered"], report["diff_rendered"]


def test_a_neighbour_committing_every_100ms_does_not_stop_the_read(scaled_ns: str) -> None:
    """read_table completes (the generation moves several times meanwhile) and equals a
    quiet read; a subscriber sees the neighbour's commits with a foreign port id and a
    commit through the Python binding in this process with one of its own."""
    report = run_in(scaled_ns, "churn", str(SCALE))
    assert report["equals_quiet"], report["diff_quiet"]
    assert report["equals_rendered"]
    assert report["neighbour_messages"] > 0 and report["neighbour_portids_foreign"]
    assert report["own_messages"] > 0 and report["own_portid_is_ours"]


def test_a_commit_in_the_middle_of_a_dump(scaled_ns: str) -> None:
    """Another table's commit inside the (family-wide, flagged NLM_F_DUMP_INTR) chain
    dump keeps the pass; this table's commit inside an element dump (which the kernel
    does not flag) is caught by the generation and the notifications, and read again; so
    is a set deleted between the set dump and its element dump (ENOENT)."""
    report = run_in(scaled_ns, "interrupt", str(SCALE))
    assert report["other_table"] == {"attempts": 1, "interrupted": True, "equals": True}
    assert report["own_table"] == {"attempts": 2, "has_new_element": True, "equals_a_fresh_read": True}
    assert report["set_gone"] == {"attempts": 2, "has_set": False, "equals_a_fresh_read": True}
