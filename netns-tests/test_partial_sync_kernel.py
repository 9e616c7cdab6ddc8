"""Partial syncs against the real kernel: after every one, the table read back equals the
agent's mirror (so planning only the changed identities never drifts from the kernel)."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid

from gwtest import ROOT


def test_random_partial_syncs_keep_kernel_and_mirror_equal() -> None:
    ns = f"ngwseq-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for seed in (1, 2, 3):
            out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "netns-tests/kernel_sequence.py",
                                  str(seed), "120"], cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            report = json.loads(out.stdout.strip().splitlines()[-1])
            assert report["partial"] == 120 and report["mismatches"] == [], report
            subprocess.run(["ip", "netns", "exec", ns, "nft", "flush", "ruleset"], check=True)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
