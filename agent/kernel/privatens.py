"""One of the agent's modules run in a private, empty network namespace (`unshare --net`,
root): the same libnftables and kernel as the caller's, nothing of the caller's namespace
touched. For `render --text` (agent/kernel/nfttext.py) and `diff`'s capability probe
(agent/kernel/privateprobe.py)."""
from __future__ import annotations

import subprocess
import sys


def run_private(module: str, *args: str, input: str | None = None, timeout: float = 60) -> str:
    """`python -m module args` there; its stdout. RuntimeError with its stderr when it
    fails or the namespace cannot be made (not root)."""
    try:
        done = subprocess.run(["unshare", "--net", sys.executable, "-m", module, *args], input=input,
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(str(err)) from err
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or "unshare failed")
    return done.stdout
