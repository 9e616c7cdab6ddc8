"""The image users deploy, run as a gateway pod runs it: built once (images/build.sh) unless
$NATGW_TEST_IMAGE names one, started with podman with the arguments derived from the
injector's container spec (tests/podspec.py: command, env, securityContext, the token and
state volumes, the memory limit), in the lab's gateway namespace as the pod's containers
share the pod's, on the Kubernetes path against the fake API over TLS (in-cluster config:
KUBERNETES_SERVICE_HOST/PORT and the projected token directory).

Run on the host only (`make test-image`): the Debian roots' runs ignore this file."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from packaging.requirements import Requirement
from pyroute2.netns import create_socket

from agent.deploy.inject import GATEWAY_ANNOTATION, STATE_VOLUME, TOKEN_VOLUME, Options
from gwtest import APP, BACKENDS, CLIENTS, EIP, GATEWAY, ROOT, WEB, eip_doc, reply_destinations, wait_for
from lab.topology import GW_BACKEND_IP, Lab
from podman import SANDBOX, Container, image_under_test, podman, remove_built
from tests.kubefake import FakeKube
from tests.kubefake.tls import make_certs
from tests.podspec import Pod, Run, injected, materialize, run_args

API_HOST, API_PORT = "127.0.0.1", 16443  # where the pod reaches the API (here: inside its own namespace)
RULES, EIPS = "iptables-dnat-rules", "iptables-eips"
PODS = ROOT / "tests" / "fixtures" / "kube-ovn"  # gateway pods as kube-ovn's controller makes them
POD = PODS / "statefulset-pod.yaml"
HA_POD = PODS / "deployment-pod.yaml"  # the HA form: a ReplicaSet's pod
MEMORY_JSON = ROOT / "build" / "image-memory.json"
# A generous sanity bound for the whole container (supervisor and worker): measured here
# 42 MiB (cgroup rss, 2 identities; 67 MiB of VmRSS summed); the injector's limit is 256Mi.
MEMORY_SANE = 200 << 20


@pytest.fixture(scope="session")
def image() -> Iterator[str]:
    built = image_under_test()
    yield built
    remove_built(built)


@pytest.fixture
def api(lab: Lab, tmp_path: Path) -> Iterator[tuple[FakeKube, Path]]:
    """The fake API over TLS inside the gateway namespace, and its CA certificate."""
    certs = make_certs(tmp_path / "pki", API_HOST)
    sock = create_socket(lab.gw_ns, socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((API_HOST, API_PORT))
    with FakeKube(sock, bookmark_interval=1.0, tls=certs.server_context()) as fake:
        yield fake, certs.ca


class PodRun:
    """The agent's container as the injector puts it in a kube-ovn gateway pod, its volumes
    laid out on the host; start() runs a new container of it (removed at the end)."""

    def __init__(self, lab: Lab, image: str, ca: Path, tmp_path: Path, form: Path = POD) -> None:
        import yaml

        doc = yaml.safe_load(form.read_text())
        container, volumes = injected(doc, Options(image=image, api_host=API_HOST, api_port=str(API_PORT)))
        self.pod = Pod.of(doc)
        self.dirs = {TOKEN_VOLUME: tmp_path / "token", STATE_VOLUME: tmp_path / "state"}
        for directory in self.dirs.values():
            directory.mkdir()
        materialize(volumes[TOKEN_VOLUME], self.pod, self.dirs[TOKEN_VOLUME], "fake-token",
                    {"kube-root-ca.crt": {"ca.crt": ca.read_text()}})
        self.spec, self.volumes, self.lab, self.image = container, volumes, lab, image
        self.containers: list[Container] = []

    def derive(self) -> Run:
        return run_args(self.spec, self.volumes, self.pod, self.dirs, f"ns:/run/netns/{self.lab.gw_ns}",
                        uuid.uuid4().hex[:6])

    def start(self) -> Container:
        container = Container(self.derive())
        self.containers.append(container)
        return container.start()

    def remove_all(self) -> None:
        for container in self.containers:
            sys.stderr.write(f"--- {container.name}\n{container.log_text()[-4000:]}")
            container.remove()

    def nft(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`nft ARGS` in the gateway namespace with the image's nft, the version that wrote
        the table: Debian 12's nft 1.0.6 dies of SIGSEGV listing the services map nft 1.1.3
        made (seen here), as an older nft may on any newer table."""
        return podman("run", "--rm", *SANDBOX, "--network", f"ns:/run/netns/{self.lab.gw_ns}", "--cap-drop", "ALL",
                      "--cap-add", "NET_ADMIN", "--entrypoint", "nft", self.image, *args, check=check)

    def ruleset(self) -> str:
        return self.nft("-s", "list", "table", "ip", "natgw").stdout


@pytest.fixture
def pod(lab: Lab, image: str, api: tuple[FakeKube, Path], tmp_path: Path) -> Iterator[PodRun]:
    running = PodRun(lab, image, api[1], tmp_path)
    try:
        yield running
    finally:
        running.remove_all()


def identities(pod: PodRun) -> int:
    done = pod.nft("-j", "list", "map", "ip", "natgw", "services", check=False)
    if done.returncode != 0:
        return 0  # no table yet
    return sum(len(o["map"].get("elem", [])) for o in json.loads(done.stdout)["nftables"] if "map" in o)


def wait_programmed(pod: PodRun, container: Container, count: int = 2) -> None:
    """Until the kernel holds `count` identities; on a timeout, the container's last
    warnings say why (an API it cannot use, a refused transaction)."""
    try:
        wait_for(lambda: identities(pod) == count, 30, 0.2, what=f"the agent in its container to program {count}")
    except AssertionError as exc:
        warnings = [e for e in container.logs() if e.get("level") in ("warning", "error")]
        raise AssertionError(f"{exc}; its last warnings: {warnings[-3:]}") from None


def serve_rules(fake: FakeKube, gateway: str = GATEWAY) -> None:
    fake.create(EIPS, eip_doc(gateway=gateway))
    for doc in (*WEB, *APP):
        fake.create(RULES, doc)


def ready(container: Container) -> bool:
    probe = container.run.probes["readiness"]
    return container.probe(probe) == 0


def test_the_image_runs_as_the_pod_spec_says(pod: PodRun, api: tuple[FakeKube, Path]) -> None:
    fake, _ = api
    serve_rules(fake)
    container = pod.start()
    wait_programmed(pod, container)
    # The probes answer as the spec says (its readinessProbe and livenessProbe commands).
    assert set(container.run.probes) == {"readiness", "liveness"}
    wait_for(lambda: ready(container), 10, 0.2, what="the readiness probe")
    assert container.probe(container.run.probes["liveness"]) == 0
    # It reached the API over TLS, verifying the server against the token directory's
    # ca.crt (the client refuses it otherwise: tests/test_kubefake_tls.py), and watches.
    assert any(r.verb == "watch" for r in fake.requests)

    spread = pod.lab.tcp_connect(EIP, 80, 60)
    assert spread["failed"] == 0 and all(spread["by_backend"][n] > 0 for n in BACKENDS), spread
    pinned = pod.lab.tcp_connect(EIP, 443, 40, sources=CLIENTS)
    assert pinned["failed"] == 0
    held = {client: sorted(b for b, n in per.items() if n) for client, per in pinned["by_source"].items()}
    assert set(held) == set(CLIENTS) and all(len(b) == 1 for b in held.values()), held

    memory = container.memory()
    record_memory(container, memory)
    assert memory["limit_bytes"] == 256 << 20  # the spec's limit, on the container's cgroup
    assert 0 < memory["cgroup_rss_bytes"] < MEMORY_SANE, memory

    # The worker killed inside the container: the supervisor (PID 1) starts another, and
    # a stream of connections meanwhile fails none.
    worker = wait_for(container.worker_pid, 10, 0.2, what="the worker")
    before = pod.ruleset()
    stream = Stream(pod.lab)
    try:
        time.sleep(1.0)
        # The shell's kill: the image has no procps (/bin/kill).
        assert container.exec("sh", "-c", f"kill -9 {worker}").returncode == 0
        wait_for(lambda: (pid := container.worker_pid()) and pid != worker, 10, 0.2, what="a new worker")
        wait_for(lambda: ready(container), 15, 0.2, what="the new worker ready")
        time.sleep(1.0)
    finally:
        results = stream.stop()
    assert results and all(r["failed"] == 0 for r in results), results
    assert sum(r["count"] for r in results) >= 20, results
    assert container.running(), "the supervisor (the container's main process) ended"
    restarts = [e for e in container.logs() if e.get("event") == "supervisor: worker ended; starting it again"]
    assert len(restarts) == 1 and restarts[0]["code"] == -signal.SIGKILL, restarts
    assert pod.ruleset() == before


def test_podman_stop_leaves_the_rules_and_a_new_container_sends_nothing(pod: PodRun,
                                                                        api: tuple[FakeKube, Path]) -> None:
    serve_rules(api[0])
    api[0].bookmark_interval = None  # nothing from the API wakes the agent: idle, as most of its life
    first = pod.start()
    wait_programmed(pod, first)
    wait_for(lambda: ready(first), 10, 0.2, what="the readiness probe")
    assert [e for e in first.logs() if e.get("event") == "synced" and e.get("commands")]  # it did program them
    before = pod.ruleset()
    time.sleep(2.0)  # idle: no change, no bookmark
    took = time.monotonic()
    first.stop(grace=5)
    took = time.monotonic() - took
    print(f"\npodman stop: {took:.1f} s, exit code {first.exit_code()}")
    # SIGTERM to the supervisor, on to the worker: both gone within a second, exit 0 (the
    # watches blocked on a quiet stream once held the worker 4.2 s, two joins of 2 s).
    assert (took < 1.0, first.exit_code()) == (True, 0), f"podman stop took {took:.1f} s"
    assert not first.running()
    assert pod.ruleset() == before  # the data plane outlives the container
    assert pod.lab.tcp_connect(EIP, 80, 10)["failed"] == 0

    api[0].clear_requests()
    second = pod.start()  # a new container started the same way, same volumes
    wait_for(lambda: ready(second), 30, 0.2, what="the new container ready")
    wait_for(lambda: any(r.verb == "watch" for r in api[0].requests), 10, 0.2, what="its watch")
    time.sleep(1.0)
    assert pod.ruleset() == before
    # It read the kernel back and found nothing to send: a no-op sync logs no "synced".
    logs = second.logs()
    assert any(e.get("event") == "starting" for e in logs), logs[:5]
    assert [e for e in logs if e.get("event") == "synced" and e.get("commands")] == []


def test_the_ha_form_masquerades_as_the_injector_says(lab: Lab, image: str, api: tuple[FakeKube, Path],
                                                      tmp_path: Path) -> None:
    """Issue 29: the agent's container as the injector puts it into an HA gateway's pod (a
    ReplicaSet's) runs with --masquerade: its table masquerades the agent's connections,
    the start-up log says so, and a connection's answer is addressed to the gateway's own
    eth0 address, not to the client."""
    import yaml

    running = PodRun(lab, image, api[1], tmp_path, HA_POD)
    try:
        assert "--masquerade" in running.spec["command"]
        serve_rules(api[0], yaml.safe_load(HA_POD.read_text())["metadata"]["annotations"][GATEWAY_ANNOTATION])
        container = running.start()
        wait_programmed(running, container)
        assert 'oifname "eth0" ct mark & 0x00004000 == 0x00004000 masquerade fully-random' in running.ruleset()
        assert [e["masquerade"] for e in container.logs() if e.get("event") == "starting"] == ["eth0"]
        assert lab.tcp_connect(EIP, 80, 10)["failed"] == 0
        assert reply_destinations(lab, "tcp", None, 80) == {GW_BACKEND_IP}
    finally:
        running.remove_all()


def test_the_image_holds_the_agent_python_and_nftables_and_nothing_for_tests(image: str) -> None:
    code = ("import importlib.metadata as m, importlib.util as u, json, shutil, sys\n"
            "import agent.cli, agent.deploy.supervise, nftables\n"
            "print(json.dumps({'python': sys.version.split()[0], 'nft': shutil.which('nft'),\n"
            " 'entry_points': [shutil.which(n) for n in ('natgw-agent', 'natgw-supervise')],\n"
            " 'absent': {n: u.find_spec(n) is None for n in ('pytest', 'scapy', 'hypothesis', 'lab', 'tests')},\n"
            " 'dists': {d.metadata['Name'].lower().replace('_', '-'): d.version for d in m.distributions()}}))\n")
    done = podman("run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
                  "--entrypoint", "python3", image, "-c", code)
    found = json.loads(done.stdout)
    assert found["nft"] and all(found["entry_points"]), found
    assert all(found["absent"].values()), found["absent"]
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    unmet = []
    for line in dependencies:
        requirement = Requirement(line)
        version = found["dists"].get(requirement.name.lower().replace("_", "-"))
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            unmet.append(f"{line} (image: {version})")
    assert unmet == [], f"pyproject.toml's dependencies the image does not satisfy: {unmet}"
    print(f"\nimage {image}: Python {found['python']}, "
          f"{', '.join(f'{n} {v}' for n, v in sorted(found['dists'].items()))}")


class Stream:
    """Fresh TCP connections to the EIP, in batches of 5, one after another until stop():
    a failed one shows in its batch's count of failures."""

    def __init__(self, lab: Lab) -> None:
        self.lab, self.results = lab, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.results.append(self.lab.tcp_connect(EIP, 80, 5, timeout=1.0))

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(60)
        return self.results


def record_memory(container: Container, memory: dict[str, Any]) -> None:
    """Printed (visible with -s) and kept in build/image-memory.json."""
    summary = {**memory, "image": container.run.args[-1], "identities": 2, "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    MEMORY_JSON.parent.mkdir(exist_ok=True)
    MEMORY_JSON.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\ncontainer memory: cgroup rss {memory['cgroup_rss_bytes'] / 2**20:.1f} MiB, usage "
          f"{memory['cgroup_usage_bytes'] / 2**20:.1f} MiB, VmRSS summed over {memory['processes']} processes "
          f"{memory['vmrss_sum_bytes'] / 2**20:.1f} MiB (limit {memory['limit_bytes'] / 2**20:.0f} MiB)")
