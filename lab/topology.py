"""A throw-away NAT gateway lab in network namespaces, driving real traffic.

Topology (NAME = "ngw" + 6 hex chars, unique per Lab)::

    NAME-client                NAME-gw                            NAME-bK
    eth0 172.18.0.100/24 <-> net1 172.18.0.1/24               eth0 10.0.1.(10+K)/24
         + .101 .. .140           + EIPs 172.18.0.10, .11     default via 10.0.1.1
                                  eth0 (bridge) 10.0.1.1/24 <-> vbK (bridge port)
                                                             <-> vbv: NAME-vpc (Lab(vpc_client=True))
                                                                 eth0 10.0.1.50/24 + .51 .. .60
                                                                 default via 10.0.1.1

NAME-vpc is a client inside the VPC, beside the backends: reaching an EIP it crosses the
gateway's eth0 twice (in, DNAT, out again), so its answer needs the hairpin SNAT.

Each backend runs ``lab.traffic serve``: TCP 8080 and 9090 and UDP 5353
answer with the backend's name ("b1\\n").  Traffic generators and sniffers run
as ``lab.traffic`` child processes inside the namespaces; scapy is only
ever imported there, never in this process.

Used by the demo and the netns test suite::

    with Lab() as lab:
        subprocess.Popen(lab.gw_exec_argv(["natgw-agent", ...]))
        print(lab.tcp_connect("172.18.0.10", 80, 100))
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import re
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

CLIENT_IP = "172.18.0.100"
CLIENT_EXTRA_IPS = [f"172.18.0.{i}" for i in range(101, 141)]
GW_NET1_IP = "172.18.0.1"
EIPS = ["172.18.0.10", "172.18.0.11"]
GW_BACKEND_IP = "10.0.1.1"
VPC_CLIENT_IP = "10.0.1.50"
VPC_CLIENT_EXTRA_IPS = [f"10.0.1.{i}" for i in range(51, 61)]
BACKEND_TCP_PORTS = (8080, 9090)
BACKEND_UDP_PORT = 5353

READY_TIMEOUT = 15.0  # scapy import alone takes ~1 s; be generous on slow CI

# Project root, so children can import `agent` even without an installed package.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)

# A running Lab holds an flock on LOCK_DIR/<id>.lock (released by the kernel
# when its process dies), so cleanup_stale() in another process can tell a
# live lab from a crashed one.
LOCK_DIR = Path("/run/ngw-lab")


class LabError(RuntimeError):
    """Building or driving the lab failed."""


def _ns_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}[0-9a-f]{{6}}-(client|vpc|router|gw[0-9]*|b[0-9]+)$")


def _run(argv: Sequence[str], input: str | None = None, timeout: float = 30.0) -> str:
    """Run a setup command; raise LabError with its stderr if it fails."""
    try:
        proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(argv)}: {exc}") from exc
    if proc.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _list_netns() -> list[str]:
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _try_lock(path: Path) -> IO[bytes] | None:
    """Exclusive non-blocking flock on `path`; None if someone holds it."""
    f = open(path, "ab")  # noqa: SIM115 - kept open to hold the lock
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def cleanup_stale(prefix: str = "ngw") -> list[str]:
    """Delete namespaces left behind by a crashed lab; returns the deleted names.

    Only names of the exact lab shape (``ngw`` + 6 hex + ``-client|-vpc|-router|-gw[N]|-bN``)
    are touched, and never those of a lab whose owner process is alive
    (in this or any other process: it holds the lab's lock file).
    """
    pattern = _ns_pattern(prefix)
    by_id: dict[str, list[str]] = {}
    for ns in _list_netns():
        if pattern.match(ns):
            by_id.setdefault(ns.split("-", 1)[0], []).append(ns)
    deleted = []
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    for lab_id, names in by_id.items():
        lock_path = LOCK_DIR / f"{lab_id}.lock"
        lock = _try_lock(lock_path)
        if lock is None:
            continue  # a live lab
        try:
            for ns in names:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
                deleted.append(ns)
            lock_path.unlink(missing_ok=True)
        finally:
            lock.close()
    return deleted


def _read_line(stream: IO[bytes], deadline: float) -> bytes:
    """Read one line from an unbuffered pipe, giving up at `deadline`.

    Byte-wise os.read keeps nothing in a Python buffer, so a later
    communicate() on the same pipe sees everything that follows.
    """
    fd = stream.fileno()
    line = bytearray()
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no complete line before the deadline")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            byte = os.read(fd, 1)
            if not byte:  # EOF: the child exited
                break
            line += byte
    return bytes(line)


def _last_json_line(text: str, what: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict):
            return result
    raise LabError(f"{what}: no JSON result in output {text!r}")


class Lab:
    """Client, gateway and backend namespaces wired like a VPC NAT gateway.

    Use as a context manager (``with Lab() as lab``) or call start()/close().
    close() is idempotent, registered with atexit, and may be called from a
    signal handler (e.g. on Ctrl-C in the demo).
    """

    def __init__(self, backends: int = 3, prefix: str = "ngw", vpc_client: bool = False) -> None:
        if not 1 <= backends <= 50:
            raise ValueError("backends must be between 1 and 50")
        self.id = prefix + secrets.token_hex(3)
        self.client_ns = f"{self.id}-client"
        self.vpc_ns = f"{self.id}-vpc" if vpc_client else None
        self.vpc_client_ip = VPC_CLIENT_IP
        self.vpc_client_extra_ips = list(VPC_CLIENT_EXTRA_IPS)
        self.gw_ns = f"{self.id}-gw"
        self.backend_names = [f"b{k}" for k in range(1, backends + 1)]
        self.backend_ns = [f"{self.id}-{name}" for name in self.backend_names]
        self.backend_ips = [f"10.0.1.{10 + k}" for k in range(1, backends + 1)]
        self.client_ip = CLIENT_IP
        self.client_extra_ips = list(CLIENT_EXTRA_IPS)
        self.eips = list(EIPS)
        self._created_ns: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logdir: str | None = None
        self._logs: dict[int, str] = {}  # child pid -> its stderr log
        self._lock: IO[bytes] | None = None
        self._lock_path = LOCK_DIR / f"{self.id}.lock"
        self._started = False
        self._closed = False

    @property
    def namespaces(self) -> list[str]:
        return [self.client_ns, *([self.vpc_ns] if self.vpc_ns else []), self.gw_ns, *self.backend_ns]

    # ------------------------------------------------------------- lifecycle

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Build the topology and start the backend servers (waits until ready)."""
        if self._started or self._closed:
            raise LabError("a Lab can only be started once")
        self._started = True
        atexit.register(self.close)
        try:
            # Take the lock before creating anything, so that a concurrent
            # cleanup_stale() never sees our namespaces unlocked.
            LOCK_DIR.mkdir(parents=True, exist_ok=True)
            self._lock = _try_lock(self._lock_path)
            if self._lock is None:
                raise LabError(f"lock {self._lock_path} is held by someone else")
            self._logdir = tempfile.mkdtemp(prefix=f"{self.id}-")
            self._build()
            self._start_servers()
        except BaseException:
            # Also on KeyboardInterrupt: never leave half a lab behind.
            self.close()
            raise

    def close(self) -> None:
        """Kill our child processes and delete our namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True  # set first: a re-entrant call (signal) returns at once
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self._procs.clear()
        # Deleting a namespace also destroys the veths and the bridge in it.
        for ns in reversed(self._created_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._created_ns.clear()
        if self._logdir:
            shutil.rmtree(self._logdir, ignore_errors=True)
        if self._lock is not None:
            self._lock_path.unlink(missing_ok=True)
            self._lock.close()
            self._lock = None
        atexit.unregister(self.close)

    # ----------------------------------------------------------------- build

    def _batch(self, ns: str, commands: list[str]) -> None:
        # One `ip` process per namespace instead of one per command: fast.
        _run(["ip", "-n", ns, "-batch", "-"], input="\n".join(commands) + "\n")

    def _build(self) -> None:
        for ns in self.namespaces:
            # Recorded first: if we are interrupted while `ip` runs, close()
            # still deletes it (deleting a missing namespace is harmless).
            self._created_ns.append(ns)
            _run(["ip", "netns", "add", ns])

        # Before any interface exists, so the "default" values apply to them.
        _run(self.gw_exec_argv([
            "sysctl", "-qw",
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ]))

        # A bridge port's frames go through iptables and nftables when br_netfilter is loaded
        # (docker loads it; new namespaces inherit call-iptables=1): conntrack would then see
        # a backend's direct answer to a VPC client and un-NAT it on the bridge, which no
        # real gateway does (its eth0 is a port of OVN's switch, not a bridge). Off here.
        bridge_nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if bridge_nf.exists():
            _run(self.gw_exec_argv(["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"]))

        # Links are created from inside the gw namespace with the peer placed
        # straight into the other namespace: nothing appears in the root ns.
        gw = ["link set lo up", f"link add net1 type veth peer name eth0 netns {self.client_ns}"]
        gw.append("link add eth0 type bridge")
        for k, ns in enumerate(self.backend_ns, start=1):
            gw += [
                f"link add vb{k} type veth peer name eth0 netns {ns}",
                f"link set vb{k} master eth0",
                f"link set vb{k} up",
            ]
        if self.vpc_ns:
            gw += [f"link add vbv type veth peer name eth0 netns {self.vpc_ns}", "link set vbv master eth0",
                   "link set vbv up"]
        gw += ["link set net1 up", "link set eth0 up", f"addr add {GW_NET1_IP}/24 dev net1"]
        gw += [f"addr add {eip}/24 dev net1" for eip in self.eips]
        # The bridge takes its MAC from its ports; address it after enslaving.
        gw.append(f"addr add {GW_BACKEND_IP}/24 dev eth0")
        self._batch(self.gw_ns, gw)

        client = ["link set lo up", "link set eth0 up", f"addr add {self.client_ip}/24 dev eth0"]
        client += [f"addr add {ip}/24 dev eth0" for ip in self.client_extra_ips]
        self._batch(self.client_ns, client)

        if self.vpc_ns:
            vpc = ["link set lo up", "link set eth0 up", f"addr add {self.vpc_client_ip}/24 dev eth0"]
            vpc += [f"addr add {ip}/24 dev eth0" for ip in self.vpc_client_extra_ips]
            self._batch(self.vpc_ns, [*vpc, f"route add default via {GW_BACKEND_IP}"])

        for ns, ip in zip(self.backend_ns, self.backend_ips):
            self._batch(ns, [
                "link set lo up",
                "link set eth0 up",
                f"addr add {ip}/24 dev eth0",
                f"route add default via {GW_BACKEND_IP}",
            ])

    def _start_servers(self) -> None:
        servers = []
        for name, ns in zip(self.backend_names, self.backend_ns):
            args = ["serve", "--name", name, "--udp-port", str(BACKEND_UDP_PORT)]
            for port in BACKEND_TCP_PORTS:
                args += ["--tcp-port", str(port)]
            servers.append(self._start_traffic(ns, args, f"serve-{name}"))
        for proc in servers:
            self._wait_ready(proc, READY_TIMEOUT)

    # ------------------------------------------------------------- processes

    def gw_exec_argv(self, argv: Sequence[str]) -> list[str]:
        """argv that runs `argv` inside the gateway namespace."""
        return ["ip", "netns", "exec", self.gw_ns, *argv]

    def run_in(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """subprocess.run(argv) inside namespace `ns`.

        Output is captured as text unless the caller says otherwise.
        """
        if not {"stdout", "stderr", "capture_output"} & kw.keys():
            kw["capture_output"] = True
        if not {"text", "encoding", "universal_newlines"} & kw.keys():
            kw["text"] = True
        return subprocess.run(["ip", "netns", "exec", ns, *argv], **kw)

    def popen_in(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """subprocess.Popen(argv) inside namespace `ns`; close() kills it."""
        proc: subprocess.Popen[Any] = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)
        self._procs.append(proc)
        return proc

    def _traffic_argv(self, args: Sequence[str]) -> list[str]:
        return [sys.executable, "-m", "lab.traffic", *args]

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO_ROOT, env.get("PYTHONPATH")]))
        return env

    def _start_traffic(self, ns: str, args: Sequence[str], label: str) -> subprocess.Popen[bytes]:
        """Start a long-running lab.traffic child (prints "ready", stops on stdin EOF)."""
        assert self._logdir is not None
        path = os.path.join(self._logdir, f"{label}.log")
        log = open(path, "wb")  # noqa: SIM115
        try:
            proc = self.popen_in(
                ns,
                self._traffic_argv(args),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                bufsize=0,  # see _read_line
                env=self._child_env(),
            )
        finally:
            log.close()  # the child holds its own copy
        self._logs[proc.pid] = path
        return proc

    def _log_tail(self, proc: subprocess.Popen[Any]) -> str:
        path = self._logs.get(proc.pid)
        if path is None or not os.path.exists(path):
            return ""
        return Path(path).read_text(errors="replace")[-2000:]

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        assert proc.stdout is not None
        try:
            line = _read_line(proc.stdout, time.monotonic() + timeout)
        except TimeoutError:
            line = b"<timeout>"
        if line.strip() != b"ready":
            raise LabError(
                f"{' '.join(map(str, proc.args))}: not ready ({line!r}, exit={proc.poll()})\n"  # type: ignore[arg-type]
                f"{self._log_tail(proc)}"
            )

    def _stop(self, proc: subprocess.Popen[bytes], timeout: float) -> str:
        """Close stdin of a long-running child and collect its final output."""
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        finally:
            if proc in self._procs:
                self._procs.remove(proc)
        return out.decode(errors="replace")

    # --------------------------------------------------------------- traffic

    def _run_traffic(self, ns: str, args: list[str], timeout: float) -> dict[str, Any]:
        if not self._started or self._closed:
            raise LabError("lab is not running")
        try:
            proc = self.run_in(ns, self._traffic_argv(args), env=self._child_env(), timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise LabError(f"lab.traffic {args[0]} timed out after {timeout:.0f}s") from exc
        if proc.returncode != 0:
            raise LabError(f"lab.traffic {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return _last_json_line(proc.stdout, f"lab.traffic {args[0]}")

    def _with_all_backends(self, result: dict[str, Any]) -> dict[str, Any]:
        # Every backend appears in by_backend, with 0 if it got nothing.
        by_backend = {name: 0 for name in self.backend_names}
        by_backend.update(result.get("by_backend", {}))
        result["by_backend"] = by_backend
        return result

    @staticmethod
    def _source_args(sources: Sequence[str] | None) -> list[str]:
        return [arg for src in sources or [] for arg in ("--source", src)]

    def tcp_connect(
        self,
        eip: str,
        port: int,
        count: int,
        sources: Sequence[str] | None = None,
        timeout: float = 2.0,
        ns: str | None = None,
    ) -> dict[str, Any]:
        """`count` sequential fresh TCP connections from the client (or `ns`).

        Connection i binds to sources[i % len(sources)] when given.  Returns
        {"by_backend": {"b1": n, ...}, "failed": n, "errors": {"timeout": n, ...},
        "by_source": {"172.18.0.101": {"b2": n}, ...}, "count": count}.
        """
        return self._client_traffic("connect", eip, port, count, sources, timeout, ns)

    def udp_query(
        self,
        eip: str,
        port: int,
        count: int,
        sources: Sequence[str] | None = None,
        timeout: float = 1.0,
        same_flow: bool = False,
        ns: str | None = None,
    ) -> dict[str, Any]:
        """`count` UDP queries; each from a new source port (a new conntrack
        flow) unless `same_flow`, which reuses one socket (sources[0]).
        Same result shape as tcp_connect()."""
        return self._client_traffic("udp", eip, port, count, sources, timeout, ns,
                                    ["--same-flow"] if same_flow else [])

    def _client_traffic(self, kind: str, eip: str, port: int, count: int, sources: Sequence[str] | None,
                        timeout: float, ns: str | None, extra: Sequence[str] = ()) -> dict[str, Any]:
        args = [kind, "--dst", eip, "--port", str(port), "--count", str(count),
                "--timeout", str(timeout), *self._source_args(sources), *extra]
        result = self._run_traffic(ns or self.client_ns, args, timeout=30 + count * (timeout + 0.5))
        return self._with_all_backends(result)

    def udp_stream(self, eip: str, port: int, ns: str | None = None, source: str | None = None,
                   interval: float = 0.05) -> UdpStream:
        """Start one UDP flow from the client (or `ns`) to eip:port, a datagram every
        `interval` s, answered or not; stop() returns [(wall time, backend name)] per answer."""
        args = ["stream", "--dst", eip, "--port", str(port), "--interval", str(interval)]
        if source:
            args += ["--source", source]
        proc = self._start_traffic(ns or self.client_ns, args, f"stream-{port}")
        self._wait_ready(proc, READY_TIMEOUT)
        return UdpStream(self, proc)

    def udp_query_same_flow(
        self,
        eip: str,
        port: int,
        count: int,
        sources: Sequence[str] | None = None,
        timeout: float = 1.0,
        ns: str | None = None,
    ) -> dict[str, Any]:
        """udp_query() over a single flow (one socket, one source port)."""
        return self.udp_query(eip, port, count, sources, timeout, same_flow=True, ns=ns)

    def scapy_syn_spread(
        self,
        eip: str,
        port: int,
        count: int,
        backend_port: int = 8080,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        """Send `count` scapy SYNs (distinct source ports) from the client to
        eip:port and count, per backend, the distinct (src, sport) SYNs that
        arrive on its eth0 for `backend_port`.

        Returns {"by_backend": {"b1": n, ...}, "sent": count}.
        """
        if not self._started or self._closed:
            raise LabError("lab is not running")
        sniffers: list[tuple[str, subprocess.Popen[bytes]]] = []
        try:
            for name, ns in zip(self.backend_names, self.backend_ns):
                # Not the gateway's own SYNs: the agent's health checks connect to the backends too.
                args = ["sniff", "--iface", "eth0", "--dport", str(backend_port), "--duration", str(timeout),
                        "--ignore-source", GW_BACKEND_IP]
                sniffers.append((name, self._start_traffic(ns, args, f"sniff-{name}")))
            # Each sniffer has seen its own canary SYN before saying "ready".
            for _, proc in sniffers:
                self._wait_ready(proc, READY_TIMEOUT)
            sent = self._run_traffic(
                self.client_ns,
                ["syn", "--dst", eip, "--dport", str(port), "--count", str(count), "--src", self.client_ip],
                timeout=timeout,
            )
            by_backend = {}
            for name, proc in sniffers:
                by_backend[name] = int(_last_json_line(self._stop(proc, 10.0), f"sniff {name}")["syns"])
        finally:
            for _, proc in sniffers:
                if proc.poll() is None:
                    self._stop(proc, 1.0)
        return {"by_backend": by_backend, "sent": int(sent["sent"])}


class UdpStream:
    """A running lab.traffic stream (Lab.udp_stream)."""

    def __init__(self, lab: Lab, proc: subprocess.Popen[bytes]) -> None:
        self._lab, self._proc = lab, proc

    def stop(self) -> list[tuple[float, str]]:
        out = self._lab._stop(self._proc, 10.0)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return [(line["t"], line["name"]) for line in lines if "t" in line]


class Namespaces(Lab):
    """Bare namespaces named, locked and cleaned up as a lab's (NAME-<role>, role one of
    client, vpc, gw, bN), with nothing in them but a loopback: for the benchmarks' cases
    that wire their own. close() flushes each one's nftables ruleset before deleting it,
    so that a big table is freed now and not by the kernel's work queue after `ip netns
    del` returns, while the next case is timed."""

    def __init__(self, roles: Sequence[str] = ("gw",), prefix: str = "ngw") -> None:
        super().__init__(backends=1, prefix=prefix)
        self.names = {role: f"{self.id}-{role}" for role in roles}

    @property
    def namespaces(self) -> list[str]:
        return list(self.names.values())

    def _build(self) -> None:
        for ns in self.namespaces:
            self._created_ns.append(ns)  # first: see Lab._build
            _run(["ip", "netns", "add", ns])
            self._batch(ns, ["link set lo up"])

    def _start_servers(self) -> None:
        pass

    def close(self) -> None:
        if not self._closed:
            for ns in self._created_ns:
                subprocess.run(["ip", "netns", "exec", ns, "nft", "flush", "ruleset"], capture_output=True,
                               timeout=300, check=False)
        super().close()
