"""What every benchmark shares: commands in a namespace (made by lab/topology.py), the
machine and the code measured, a quiet machine before a timed case, and the JSON-lines
probes that do a benchmark's work inside a namespace."""
from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from lab import topology

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def child_env() -> dict[str, str]:
    """Environment of Python children: the repository importable (bench, lab and agent)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    return env


def run(argv: Sequence[str], input: str | None = None, timeout: float = 600.0,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}... failed (rc {proc.returncode}): {proc.stderr.strip()[:2000]}")
    return proc


def in_ns(ns: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def exec_in(ns: str, argv: Sequence[str], input: str | None = None, timeout: float = 600.0,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(in_ns(ns, argv), input=input, timeout=timeout, check=check)


def python_in(ns: str, module: str, args: Sequence[str] = (), input: str | None = None,
              timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
    """`python -m module args` inside the namespace, from the repository root."""
    proc = subprocess.run(in_ns(ns, [PYTHON, "-m", module, *args]), input=input, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{module} in {ns} failed (rc {proc.returncode}):\n{proc.stderr.strip()[-3000:]}")
    return proc


def namespaces(*roles: str) -> topology.Namespaces:
    """Fresh bare namespaces, named nb<pid>-... so that a test finds what a run left behind."""
    return topology.Namespaces(roles or ("gw",), prefix=f"nb{os.getpid()}-")


@contextmanager
def namespace() -> Iterator[str]:
    """One fresh bare namespace, by name."""
    with namespaces("gw") as lab:
        yield lab.names["gw"]


def cleanup_stale() -> list[str]:
    """Delete namespaces of earlier benchmark runs that were killed (their lock is free)."""
    listed = run(["ip", "netns", "list"]).stdout.split()
    prefixes = sorted({m[0] for name in listed if (m := re.match(r"nb\d+-", name))})
    return [ns for prefix in prefixes for ns in topology.cleanup_stale(prefix)]


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so every `with` deletes its namespaces."""
    def _raise(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)


def cpu_times() -> tuple[int, int]:
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
        b0, t0 = cpu_times()
        time.sleep(window)
        b1, t1 = cpu_times()
        if t1 == t0 or (b1 - b0) / (t1 - t0) < busy_below or time.monotonic() - start >= max_wait:
            return time.monotonic() - start


def wait_for(check: Callable[[], Any], timeout: float, interval: float, what: str) -> float:
    """Seconds until check() is true; raises after timeout."""
    t0 = time.perf_counter()
    while not check():
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
    return time.perf_counter() - t0


def end(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, wait: float = 5.0) -> int:
    """Send sig if it still runs; SIGKILL after `wait` s. Its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# --- the machine and the code measured ------------------------------------------------------

def _version(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "unknown"


def machine() -> dict[str, str]:
    return {
        "nproc": str(os.cpu_count()),
        "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "unknown"),
        "kernel": platform.release(),
        "nft": _version(["nft", "--version"]),
        "python": platform.python_version(),
        "iptables_legacy": _version(["iptables-legacy", "-V"]),
        "iptables_nft": _version(["iptables-nft", "-V"]),
        "iptables_default": _version(["iptables", "-V"]),
    }


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30,
                              check=False).stdout.rstrip("\n")
    except OSError:
        return ""


def code() -> dict[str, Any]:
    """The commit measured and the files of the agent (and the lab's neighbour) that differ
    from it in the working tree."""
    return {"commit": _git("rev-parse", "HEAD").strip() or "unknown",
            "changed": [line[3:] for line in _git("status", "--porcelain", "--", "agent", "lab").splitlines()]}


def short(ref: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", ref], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def unpack(ref: str, into: Path) -> Path:
    """The tree of commit `ref`, unpacked (not checked out: the repository is untouched)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    with tempfile.NamedTemporaryFile(suffix=".tar") as f:
        f.write(archive)
        f.flush()
        with tarfile.open(f.name) as tar:
            tar.extractall(into, filter="data") if sys.version_info >= (3, 12) else tar.extractall(into)
    return into


def versions(baseline: str | None) -> Iterator[tuple[Path, str, str]]:
    """(tree, label, commit) of each code version measured side by side: with a baseline,
    that commit unpacked aside (removed when the next is asked for); then this tree."""
    if baseline:
        commit = short(baseline)
        with tempfile.TemporaryDirectory(prefix="natgw-baseline-") as d:
            yield unpack(baseline, Path(d)), f"before ({commit})", commit
    head = code()
    commit, changed = head["commit"][:7], any(f.startswith("agent") for f in head["changed"])
    yield REPO, f"this tree ({commit}{'+changes' if changed else ''})", commit


# --- a probe: a process in a namespace that answers one JSON line per request -----------------

class Probe:
    """A child process asked one JSON line at a time (bench.busy_probe, bench.cleanup_probe);
    it prints {"ready": true} first."""

    def __init__(self, ns: str, module: str, args: Sequence[str] = ()) -> None:
        self.proc = subprocess.Popen(in_ns(ns, [PYTHON, "-m", module, *args]), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO, env=child_env())
        self.line()

    def line(self) -> dict[str, Any]:
        """The next answer (a watch's second one, too)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the probe ended (rc {self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"probe: {answer['error']}")
        return answer

    def ask(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit")
            except (OSError, RuntimeError, ValueError):
                pass
        end(self.proc)

