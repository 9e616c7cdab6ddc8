"""Run inside a namespace (child process): execute commands one after another, each timed
with perf_counter around its subprocess call, as a shell script in the gateway would.

stdin: {"jobs": [{"argv": [...], "input": "..."}...]}; stdout: {"seconds": [...],
"total": s}. Stops at the first failure (exit 1, its stderr on stderr)."""
from __future__ import annotations

import json
import subprocess
import sys
import time


def main() -> int:
    jobs = json.load(sys.stdin)["jobs"]
    seconds = []
    start = time.perf_counter()
    for job in jobs:
        t0 = time.perf_counter()
        proc = subprocess.run(job["argv"], input=job.get("input"), capture_output=True, text=True)
        seconds.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            print(f"job {len(seconds) - 1} ({' '.join(job['argv'])}) failed rc {proc.returncode}: {proc.stderr[:3000]}",
                  file=sys.stderr)
            return 1
    json.dump({"seconds": seconds, "total": time.perf_counter() - start}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
