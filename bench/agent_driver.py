"""The agent under test, as a process: `python -m agent.cli --log-format json run ...` in a
network namespace, from a code tree (this one, or an older commit unpacked aside:
common.versions), its JSON log in a file. The busy neighbour, cleanup and footprint
benchmarks all start, watch, read and stop it through this class."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any, Sequence

from agent.ops.status import query
from bench.common import PYTHON, REPO, child_env, end, in_ns

GATEWAY = "gw1"
METRICS_URL = "http://127.0.0.1:10299/metrics"  # the agent's default --metrics-addr


class Agent:
    """`source` is what follows `run --gateway gw1` (--from-dir DIR, or --token-dir ...);
    the state directory and the log are in `work`. start() again after stop() is a restart:
    the log goes on in the same file."""

    def __init__(self, ns: str, source: Sequence[str], work: Path, code: Path = REPO,
                 env: dict[str, str] | None = None, checks: bool = True) -> None:
        self.ns, self.source, self.code, self.env = ns, list(source), code, env or {}
        if not checks and "health_checks" in (code / "agent" / "settings.py").read_text():
            self.source.append("--no-health-checks")  # an older tree has no checks to turn off
        self.state = work / "state"
        self.log_path = work / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self._log: IO[bytes] | None = None

    def start(self) -> Agent:
        env = {**child_env(), "PYTHONPATH": str(self.code), "PYTHONUNBUFFERED": "1", **self.env}
        self._log = open(self.log_path, "ab")
        argv = [PYTHON, "-m", "agent.cli", "--log-format", "json", "run", "--gateway", GATEWAY, *self.source,
                "--state-dir", str(self.state)]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(in_ns(self.ns, argv), stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=self.code, env=env)
        return self

    def ready(self) -> bool:
        try:
            return bool(query(self.state / "agent.sock", "ready", timeout=1.0).get("ok"))
        except (OSError, ValueError):
            return False

    def wait_ready(self, timeout: float = 300.0, interval: float = 0.05) -> float:
        """Seconds from start() until the status socket says ready; raises if it exits."""
        while time.monotonic() - self.started < timeout:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited (rc {self.proc.returncode}): {self.tail()}")
            if self.ready():
                return time.monotonic() - self.started
            time.sleep(interval)
        raise RuntimeError(f"agent not ready in {timeout} s: {self.tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def is_agent(self) -> bool:
        """`ip netns exec` execs the command: the pid measured is the agent's own."""
        assert self.proc is not None
        try:
            return b"agent.cli" in Path(f"/proc/{self.proc.pid}/cmdline").read_bytes()
        except OSError:
            return False

    # --- what /proc says -------------------------------------------------------------------

    def ticks(self) -> tuple[int, int]:
        """(utime + stime, cutime + cstime) of the agent's process, all its threads."""
        assert self.proc is not None
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        f = stat[stat.rindex(")") + 2:].split()
        return int(f[11]) + int(f[12]), int(f[13]) + int(f[14])

    def schedstat(self) -> tuple[int, int]:
        """(nanoseconds on a CPU, times scheduled in) summed over the agent's threads."""
        assert self.proc is not None
        ns = runs = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                cpu, _wait, slices = (int(x) for x in (task / "schedstat").read_text().split())
            except (OSError, ValueError):
                continue  # a thread that ended meanwhile
            ns, runs = ns + cpu, runs + slices
        return ns, runs

    def status(self) -> dict[str, int]:
        """VmRSS and VmHWM, KiB."""
        assert self.proc is not None
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines())
        return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}

    # --- what the agent says ---------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                out.append(event)
        return out

    def synced(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("event") == "synced"]

    def drifts(self) -> int:
        return sum(1 for e in self.events() if str(e.get("event", "")).startswith("drift"))

    def memory(self) -> dict[str, Any] | None:
        try:
            return query(self.state / "agent.sock", "memory", timeout=60.0)
        except (OSError, ValueError):
            return None  # an older agent: no such query

    def metrics(self) -> str:
        script = ("import urllib.request,sys; sys.stdout.write(urllib.request.urlopen("
                  f"'{METRICS_URL}', timeout=10).read().decode())")
        return subprocess.run(in_ns(self.ns, [PYTHON, "-c", script]), capture_output=True, text=True,
                              timeout=30).stdout

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Its exit code (SIGKILL after 15 s); None if it was never started."""
        if self.proc is None:
            return None
        rc = end(self.proc, sig, 15)
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc
