"""Network namespaces for the benchmark: unique names, always deleted, commands inside.

Names are `nb<pid>-<n>`, so a namespace left by a killed run (its pid gone) is found and
removed by the next run; a live run's namespaces are never touched."""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

PREFIX = "nb"
REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
_counter = itertools.count()
_live: list["Netns"] = []


def run(argv: Sequence[str], input: str | None = None, timeout: float = 600.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}... failed (rc {proc.returncode}): {proc.stderr.strip()[:2000]}")
    return proc


def child_env() -> dict[str, str]:
    """Environment of Python children: the repository importable (bench and agent)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    return env


def cleanup_stale() -> list[str]:
    """Delete namespaces of earlier benchmark runs whose process is gone."""
    removed = []
    out = run(["ip", "netns", "list"]).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        run(["ip", "netns", "del", name], check=False)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Netns:
    """A fresh network namespace, deleted on exit (with its nftables and iptables state
    flushed first, so the kernel's asynchronous teardown does not run into the next case)."""

    def __init__(self, role: str = "x") -> None:
        self.name = f"{PREFIX}{os.getpid()}-{next(_counter)}{role}"
        self._procs: list[subprocess.Popen[Any]] = []
        self._open = False
        self.uses_iptables_legacy = False

    def __enter__(self) -> "Netns":
        run(["ip", "netns", "add", self.name])
        self._open = True
        _live.append(self)
        self.ip("link set lo up")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # Only this namespace's rules: `ip netns exec` runs the flush inside it.
        self.exec(["nft", "flush", "ruleset"], check=False, timeout=300)
        if self.uses_iptables_legacy:
            self.exec(["iptables-legacy", "-t", "nat", "-F"], check=False)
        run(["ip", "netns", "del", self.name], check=False)
        if self in _live:
            _live.remove(self)

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def exec(self, argv: Sequence[str], input: str | None = None, timeout: float = 600.0,
             check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(self.argv(argv), input=input, timeout=timeout, check=check)

    def ip(self, command: str) -> None:
        run(["ip", "-n", self.name, *command.split()])

    def sysctl(self, key: str, value: str) -> None:
        self.exec(["sysctl", "-qw", f"{key}={value}"])

    def python(self, module: str, args: Sequence[str] = (), input: str | None = None,
               timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
        """`python -m module args` inside the namespace, from the repository root."""
        proc = subprocess.run(self.argv([PYTHON, "-m", module, *args]), input=input, capture_output=True, text=True,
                              timeout=timeout, cwd=REPO, env=child_env())
        if proc.returncode != 0:
            raise RuntimeError(f"{module} in {self.name} failed (rc {proc.returncode}):\n{proc.stderr.strip()[-3000:]}")
        return proc

    def popen_python(self, module: str, args: Sequence[str] = ()) -> subprocess.Popen[str]:
        proc = subprocess.Popen(self.argv([PYTHON, "-m", module, *args]), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=child_env())
        self._procs.append(proc)
        return proc


def close_all() -> None:
    for ns in list(reversed(_live)):
        ns.close()


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so every `with Netns()` deletes its namespace."""
    def _raise(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def settle(max_wait: float, busy_below: float = 0.15, window: float = 0.5) -> float:
    """Wait until the machine is quiet: the previous case's namespace teardown (the kernel
    frees a big table in a work queue after `ip netns del` returns) must not run on the
    CPUs while the next case is timed. Returns the seconds waited (at most about max_wait)."""
    start = time.monotonic()
    while True:
        b0, t0 = _cpu_times()
        time.sleep(window)
        b1, t1 = _cpu_times()
        if t1 == t0 or (b1 - b0) / (t1 - t0) < busy_below or time.monotonic() - start >= max_wait:
            return time.monotonic() - start
