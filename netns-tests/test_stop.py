"""SIGTERM ends an idle agent within a second, exit 0, rules in place: run directly and
under its supervisor (the container's PID 1), in a network namespace as `ip netns add`
makes it, lo down. There the health server's shutdown once waited for a connection to
itself that could not arrive, and the agent sat out its hour-long select until the
stopper's grace period ended in SIGKILL (systemd, the kubelet and podman all send SIGTERM
first)."""
from __future__ import annotations

import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from gwtest import ROOT, fresh_namespace, log_entries, wait_for


@pytest.fixture
def fresh_ns() -> Iterator[str]:
    with fresh_namespace("ngwstop") as ns:
        yield ns


def _nft(ns: str, *args: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "nft", *args], capture_output=True, text=True, check=True).stdout


def _events(log: Path) -> dict[str, dict]:
    """The first log entry of each event."""
    found: dict[str, dict] = {}
    for entry in log_entries(log):
        found.setdefault(entry.get("event", ""), entry)
    return found


def _synced(log: Path) -> bool:
    return "synced" in _events(log)


@pytest.mark.parametrize("entry", ["agent.cli", "agent.deploy.supervise"])
def test_sigterm_ends_an_idle_agent_within_a_second(fresh_ns: str, tmp_path: Path, entry: str) -> None:
    assert "state UP" not in subprocess.run(["ip", "-n", fresh_ns, "link", "show", "lo"], capture_output=True,
                                            text=True, check=True).stdout  # as a fresh namespace comes
    log = tmp_path / "agent.log"
    argv = [sys.executable, "-m", entry, "--log-format", "json", "run", "--gateway", "gw1",
            "--from-dir", str(ROOT / "examples"), "--state-dir", str(tmp_path / "state")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(["ip", "netns", "exec", fresh_ns, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_for(lambda: _synced(log), 15, what="the first sync")
        # What it runs on, said at start: the Python and the nftables (with its capabilities).
        said = _events(log)
        assert said["starting"]["python"] == platform.python_version()
        assert said["capabilities"]["nft_version"] == _nft(fresh_ns, "--version").split()[1].lstrip("v")
        time.sleep(1.0)  # idle: nothing left to do, every thread asleep
        rules = _nft(fresh_ns, "-s", "list", "table", "ip", "natgw")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        took = time.monotonic() - sent
        assert (code, took < 1.0) == (0, True), f"exit {code} after {took:.2f} s"
        assert _nft(fresh_ns, "-s", "list", "table", "ip", "natgw") == rules  # the data plane outlives the process
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
