"""The fake's answers are the kernel's: tests/fakenft_cases.py against libnftables and the
kernel in a fresh namespace."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid

from gwtest import ROOT
from tests.fakenft_cases import CASES, OK


def test_the_kernel_answers_every_case_as_the_fake_does() -> None:
    ns = f"ngwfake-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "netns-tests/scripts/fakenft_cases.py"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for case, (_, expected) in CASES.items():
        rc, err, unchanged = results[case]
        if expected == OK:
            assert rc == 0, (case, err)
        else:
            texts = expected if isinstance(expected, tuple) else (expected,)
            assert rc != 0 and any(t in err for t in texts) and unchanged, (case, err)
