"""The agent's image, built and run with podman as a gateway pod runs it (tests/podspec.py
derives the arguments from the injector's spec); used by test_image.py.

This machine's sandbox needs `--runtime runc --cgroup-manager cgroupfs` (crun refuses its
hybrid cgroups) and explicit low limits (it cannot raise them: podman's defaults fail in
setrlimit), measured here. Those are the sandbox's, not the pod's, so
they are added here and not derived."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gwtest import ROOT
from tests.podspec import Probe, Run

PODMAN = ("podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs")
SANDBOX = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
IMAGE_ENV = "NATGW_TEST_IMAGE"  # names a prebuilt image: the tests then build none
TEST_TAG = "localhost/natgw-agent:test"


class PodmanError(RuntimeError):
    """A podman command failed."""


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise PodmanError(f"podman {' '.join(args[:3])}... failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done


def image_under_test() -> str:
    """$NATGW_TEST_IMAGE if set (it must exist), else this tree's image built now as
    localhost/natgw-agent:test by images/build.sh (about 50 s) with this interpreter, whose
    virtualenv has the wheel's build tools. A failed build raises: never a skip."""
    prebuilt = os.environ.get(IMAGE_ENV)
    if prebuilt:
        podman("image", "exists", prebuilt)
        return prebuilt
    done = subprocess.run([str(ROOT / "images" / "build.sh"), TEST_TAG], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, "IMAGE_OUT": "build/image-test"}, timeout=900)
    if done.returncode != 0:
        raise PodmanError(f"images/build.sh failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    sys.stderr.write(done.stderr.splitlines()[-1] + "\n")  # its size and time
    return TEST_TAG


def remove_built(image: str) -> None:
    """Remove the image image_under_test() built (not a prebuilt one): each build leaves
    200 MB otherwise."""
    if image == TEST_TAG and not os.environ.get(IMAGE_ENV):
        podman("rmi", "--force", image, check=False)


class Container:
    """One container started from a derived Run; remove() deletes it whatever its state."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.name = run.args[run.args.index("--name") + 1]

    def start(self) -> Container:
        podman("run", "--detach", *SANDBOX, *self.run.args)
        return self

    def stop(self, grace: int = 5) -> subprocess.CompletedProcess[str]:
        return podman("stop", "--time", str(grace), self.name, timeout=grace + 30, check=False)

    def remove(self) -> None:
        podman("rm", "--force", "--time", "0", self.name, check=False)

    def exec(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return podman("exec", self.name, *argv, timeout=timeout, check=False)

    def probe(self, probe: Probe) -> int:
        """The exec probe's exit code, within its timeout as the kubelet allows it (a timeout
        fails it; podman's own start-up is given 5 s more)."""
        try:
            return self.exec(*probe.command, timeout=probe.timeout + 5).returncode
        except subprocess.TimeoutExpired:
            return -1

    def running(self) -> bool:
        done = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return done.stdout.strip() == "true"

    def exit_code(self) -> int:
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout.strip())

    def logs(self) -> list[dict[str, Any]]:
        done = podman("logs", self.name)
        lines = (done.stdout + done.stderr).splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def log_text(self) -> str:
        done = podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def processes(self) -> list[dict[str, Any]]:
        """Every process of the container as it sees them (its /proc): pid, ppid, argv."""
        code = ("import json, os\nout = []\n"
                "for p in filter(str.isdigit, os.listdir('/proc')):\n"
                " try:\n"
                "  argv = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')[:-1]\n"
                "  ppid = int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1])\n"
                " except OSError:\n  continue\n"
                " out.append({'pid': int(p), 'ppid': ppid, 'argv': [a.decode() for a in argv]})\n"
                "print(json.dumps(out))\n")
        done = self.exec("python3", "-c", code)
        if done.returncode != 0:
            raise PodmanError(f"listing {self.name}'s processes failed: {done.stderr}")
        return json.loads(done.stdout)

    def worker_pid(self) -> int | None:
        """The supervisor's worker (`python3 -m agent.cli ...`, child of PID 1), if one runs."""
        workers = [p["pid"] for p in self.processes() if p["ppid"] == 1 and "agent.cli" in p["argv"]]
        return workers[0] if len(workers) == 1 else None

    def memory(self) -> dict[str, Any]:
        """Resident memory of the whole container: its memory cgroup's count (rss: anonymous
        memory resident, and usage: with the page cache), and VmRSS summed over its processes
        (which counts pages they share once per process)."""
        pid = int(podman("inspect", "--format", "{{.State.Pid}}", self.name).stdout.strip())
        cgroup = _memory_cgroup(pid)
        stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
        procs = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        vmrss = {p: _vmrss_kb(p) for p in procs}
        return {"cgroup_rss_bytes": int(stat["total_rss"]), "cgroup_usage_bytes": int(
                    (cgroup / "memory.usage_in_bytes").read_text()),
                "limit_bytes": int((cgroup / "memory.limit_in_bytes").read_text()),
                "processes": len(procs), "vmrss_sum_bytes": sum(vmrss.values()) * 1024}


def _memory_cgroup(pid: int) -> Path:
    """The memory cgroup (v1: this machine's layout is hybrid) of a host process."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    raise PodmanError(f"process {pid} has no memory cgroup (a cgroup v2 machine: read memory.current instead)")


def _vmrss_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0  # gone meanwhile
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
