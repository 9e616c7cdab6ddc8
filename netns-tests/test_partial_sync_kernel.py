"""Partial syncs against the real kernel: after every one, the table read back equals the
agent's mirror (so planning only the changed identities never drifts from the kernel)."""
from __future__ import annotations

import json
import subprocess
import sys

from gwtest import ROOT, fresh_namespace, report_of, script_in_fresh_namespace


def test_random_partial_syncs_keep_kernel_and_mirror_equal() -> None:
    with fresh_namespace("ngwseq") as ns:
        for seed in (1, 2, 3):
            out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "netns-tests/scripts/kernel_sequence.py",
                                  str(seed), "120"], cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            report = json.loads(out.stdout.strip().splitlines()[-1])
            assert report["partial"] == 120 and report["mismatches"] == [], report
            subprocess.run(["ip", "netns", "exec", ns, "nft", "flush", "ruleset"], check=True)


def redeclare(mode: str) -> dict:
    return report_of(script_in_fresh_namespace("ngwdecl", "redeclare.py", mode))  # type: ignore[no-any-return]


def test_a_settings_change_redeclares_in_one_transaction() -> None:
    """New affinity set size and priority: the kernel takes the flush-delete-redeclare batch
    (sets deleted after the rules that used them, in the same transaction) at once, and
    the backend maps, declared in nft text, stay as they were."""
    report = redeclare("settings")
    assert report["transactions"] == 1 and report["converged"], report
    assert report["elements_before"] == report["elements_after"]
    assert report["prio"] == -161
    assert {n: d.get("size") for n, d in report["sets_after"].items() if n.startswith("aff_")} == \
        {"aff_0": 1024, "aff_1": 1024, "aff_2": 1024}
    backend_maps = {n: d for n, d in report["sets_before"].items() if n.startswith("backend_")}
    assert len(backend_maps) == 3 and all(report["sets_after"][n] == d for n, d in backend_maps.items())


def test_an_upgrade_from_separate_address_and_port_maps() -> None:
    """A table the previous layout programmed (addr_<s> + port_<s>) becomes this layout in
    one JSON transaction (and, where JSON cannot declare the backend maps, one text
    declaration before it); every backend keeps its slot (here out
    of sorted order) and the affinity sets are kept, so pinned clients stay pinned to
    their backend across the upgrade."""
    report = redeclare("upgrade")
    assert report["app_slots"] == {"10.0.1.13:9090": 0, "10.0.1.12:9090": 1, "10.0.1.11:9090": 2}, report
    assert report["aff_0"] == [["192.168.100.7", "172.18.0.10", "tcp", 443]]  # still pinned, to .13
    assert report["transactions"] == (1 if report["json_concat_maps"] else 2) and report["converged"], report
    assert {n for n in report["sets_before"] if n.startswith(("addr_", "port_"))} == \
        {"addr_0", "addr_1", "addr_2", "port_0", "port_1", "port_2"}
    assert not any(n.startswith(("addr_", "port_")) for n in report["sets_after"])
    assert report["elements_after"] == {"services": 3, "backend_0": 3, "backend_1": 3, "backend_2": 3, "chash": 1}
    assert all(report["sets_after"][n] == d for n, d in report["sets_before"].items() if n.startswith("aff_"))
