"""The systemd unit (systemd/natgw-agent.service) as a host outside Kubernetes runs it: a
Debian stable root with systemd as PID 1, under podman, in a network namespace of its own;
the agent pip-installed into /opt/natgw-agent as the unit's header
says, the gateway in /etc/default/natgw-agent, rules in /etc/natgw-agent/rules. Started:
active only once its first sync is in the kernel (Type=notify). Stopped: SIGTERM ends it
within a second, exit 0, the rules in place. (systemd brings lo up as it boots, so the
old health server's hang with lo down, which test_stop.py shows, does not arise here: this
holds the unit itself to the second.) On this host only, like test_image.py: podman runs no
container inside the Debian roots."""
from __future__ import annotations

import subprocess
import sys
import time
import uuid
from typing import Iterator

import pytest

from gwtest import ROOT, fresh_namespace, wait_for
from podman import SANDBOX, podman

TAG = "localhost/natgw-agent-systemd-host:test"
# The host's packages: systemd, and what the unit's venv sees from the system (it is made
# with --system-site-packages for the distribution's nftables binding).
PACKAGES = ("systemd,systemd-sysv,dbus,python3,python3-venv,python3-nftables,nftables,python3-structlog,"
            "python3-prometheus-client,python3-yaml,python3-kubernetes")


@pytest.fixture(scope="module")
def host_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("systemd-host")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = work.glob("*.whl")
    hooks = [f"copy-in {wheel} /tmp",
             'chroot "$1" python3 -m venv --system-site-packages /opt/natgw-agent',
             f'chroot "$1" /opt/natgw-agent/bin/pip install -q --no-deps --no-index /tmp/{wheel.name}',
             f"copy-in {ROOT / 'systemd' / 'natgw-agent.service'} /etc/systemd/system",
             f'mkdir -p "$1/etc/natgw-agent/rules" && cp {ROOT / "examples"}/* "$1/etc/natgw-agent/rules/"',
             'echo GATEWAY_NAME=gw1 > "$1/etc/default/natgw-agent"']
    done = subprocess.run(["mmdebstrap", "--quiet", "--variant=essential", f"--include={PACKAGES}", "--format=tar",
                           *(f"--customize-hook={h}" for h in hooks), "trixie", str(work / "root.tar")],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]  # a failed build fails, never skips
    podman("import", "--quiet", str(work / "root.tar"), TAG, timeout=300)
    (work / "root.tar").unlink()
    try:
        yield TAG
    finally:
        podman("rmi", "--force", TAG, check=False)


def test_the_unit_is_ready_once_synced_and_stops_within_a_second_of_sigterm(host_image: str) -> None:
    with fresh_namespace("ngwsd") as ns:
        name = f"natgw-systemd-{uuid.uuid4().hex[:6]}"
        # SYS_ADMIN: systemd sets up the unit's sandbox (ProtectSystem, PrivateTmp...) with
        # mounts; NET_ADMIN: the unit's bounding set keeps only that one.
        podman("run", "--detach", "--name", name, "--systemd=always", *SANDBOX, "--network", f"ns:/run/netns/{ns}",
               "--cap-add", "NET_ADMIN,SYS_ADMIN", host_image, "/lib/systemd/systemd")

        def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
            return podman("exec", name, *argv, timeout=timeout, check=False)

        try:
            wait_for(lambda: run("systemctl", "is-system-running").stdout.strip() in ("running", "degraded"), 60, 0.5,
                     what="systemd to boot")
            started = run("systemctl", "start", "natgw-agent")  # Type=notify: returns once READY=1 came
            assert started.returncode == 0, run("journalctl", "-u", "natgw-agent", "--no-pager").stdout[-3000:]
            assert run("systemctl", "is-active", "natgw-agent").stdout.strip() == "active"
            # The host's nft may be older than the root's (1.0.6 crashes listing 1.1.3's
            # tables): listed with the root's own.
            rules = run("nft", "-s", "list", "table", "ip", "natgw").stdout
            assert "172.18.0.10 . tcp . 80" in rules  # the first sync is in the kernel by then
            time.sleep(1.0)  # idle
            timed = run("sh", "-c", "a=$(date +%s.%N); systemctl stop natgw-agent; b=$(date +%s.%N); echo $a $b")
            began, ended = map(float, timed.stdout.split())
            state = run("systemctl", "show", "natgw-agent", "-p", "Result", "-p", "ExecMainStatus").stdout.split()
            assert (ended - began < 1.0, sorted(state)) == (True, ["ExecMainStatus=0", "Result=success"]), \
                f"systemctl stop took {ended - began:.2f} s; {state}"
            assert run("nft", "-s", "list", "table", "ip", "natgw").stdout == rules  # left in place
        finally:
            podman("rm", "--force", "--time", "0", name, check=False)
