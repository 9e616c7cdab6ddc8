"""Command line: run (the agent), render (desired state as nft JSON), show (the kernel)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from agent import log as logsetup
from agent.errors import ApplyError
from agent.ops.health import Health, serve
from agent.kernel.view import KernelView
from agent.run.loop import Source, StopEvent, run_loop
from agent.ops.metrics import Metrics
from agent.kernel.nft import IDENTIFIER, Nft
from agent.core.plan import document, one_transaction, plan
from agent.run.reconcile import connected
from agent.core.render import hairpin_of, render
from agent.ops.report import Reporter, evaluate
from agent.core.ruleset import EMPTY
from agent.kernel.nfnetlink import NetlinkError
from agent.kernel.nfttext import to_text
from agent.settings import Settings
from agent.ops.show import format_show, inspect
from agent.ops.status import StatusServer, query
from agent.deploy.supervise import supervise
from agent.deploy import webhook
from agent.kernel.caps import Capabilities
from agent.run.crdcheck import CrdCheck, reader as crd_reader
from agent.kernel.privateprobe import from_status, probe_private
from agent.ops.httpserve import host_port
from agent.deploy.inject import GATEWAY_ANNOTATION, Options as InjectOptions


def _table_name(value: str) -> str:
    # Checked here, not at the first sync: the agent names its table in nft text too (nft.py).
    if not IDENTIFIER.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r}: letters, digits and _ only, at most 64, not starting with a digit")
    return value


def _interface_name(value: str) -> str:
    # An interface name as the kernel takes it (IFNAMSIZ 16 with its NUL; no '/', no blanks).
    if not (0 < len(value.encode()) < 16) or any(c in value for c in "/: \t\n"):
        raise argparse.ArgumentTypeError(f"{value!r}: not an interface name (1-15 bytes, no '/', ':' or blanks)")
    return value


def _mark(value: str) -> int:
    try:
        mark = int(value, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: not a number (e.g. 0x4000)") from None
    if not 0 < mark <= 0xFFFFFFFF:
        raise argparse.ArgumentTypeError(f"{value!r}: a mark is 1 to 0xffffffff")
    return mark


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="natgw-agent", description=__doc__)
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto")
    p.add_argument("--log-level", default="info")
    p.add_argument("--table", default=Settings.table, type=_table_name,
                   help="the nftables table (family ip) the agent owns (letters, digits, _)")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("run", "program and keep programming the gateway"),
                       ("render", "print the desired state as the nft JSON it would send, touching nothing"),
                       ("diff", "print what differs between the desired state and the kernel; exit 1 if anything")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--gateway", default=os.environ.get("GATEWAY_NAME", ""), help="gateway name (default: $GATEWAY_NAME)")
        s.add_argument("--from-dir", type=Path, help="read rules from this directory instead of the Kubernetes API")
        s.add_argument("--kubeconfig", type=Path, help="kubeconfig for the API (default: in-cluster service account)")
        s.add_argument("--token-dir", type=Path, default=Path(os.environ["NATGW_TOKEN_DIR"]) if os.environ.get(
            "NATGW_TOKEN_DIR") else None, help="in-cluster token and ca.crt from here instead of the automount path "
                                              "(default: $NATGW_TOKEN_DIR)")
        s.add_argument("--hairpin-snat", action="store_true",
                       help="SNAT clients on the VPC side reaching an identity to its EIP, in the agent's own table "
                            "(outside Kubernetes; kube-ovn's gateway has its own hairpin rule)")
        s.add_argument("--vpc-interface", default=Settings.vpc_interface, type=_interface_name,
                       help="the gateway's VPC-side interface, for --hairpin-snat (default: %(default)s)")
        s.add_argument("--hairpin-mark", default=Settings.hairpin_mark, type=_mark,
                       help="packet mark bits --hairpin-snat uses on a hairpin flow's first packet "
                            "(default: 0x%(default)x; kube-ovn's own rule uses 0x1)")
        if name == "diff":
            s.add_argument("--state-dir", type=Path, default=Settings.state_dir,
                           help="where the running agent's status socket is: the diff uses its probed capabilities, "
                                "as its syncs do (else the probe runs in a private network namespace: root)")
        if name == "render":
            s.add_argument("--text", action="store_true",
                           help="print nft text, as the kernel would list it (root: uses a private namespace)")
        if name == "run":
            s.add_argument("--event-namespace", default=os.environ.get("POD_NAMESPACE") or Settings.event_namespace,
                           help="namespace of the Events the agent records (default: $POD_NAMESPACE, else default)")
            s.add_argument("--metrics-addr", default=Settings.metrics_addr,
                           help="host:port of /metrics (and /healthz, /livez, /readyz); loopback by default: "
                                "an address on the pod's eth0 is reachable from every workload in the tenant's VPC")
            s.add_argument("--take-over-legacy", action="store_true",
                           help="remove the legacy kube-ovn table's objects for the identities the agent serves")
            s.add_argument("--state-dir", type=Path, default=Settings.state_dir,
                           help="where the agent keeps its status socket (agent.sock)")
    show = sub.add_parser("show", help="print what the kernel holds, one block per identity")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.add_argument("--state-dir", type=Path, default=Settings.state_dir,
                      help="where the running agent's status socket is (its capabilities and problems)")
    show.add_argument("--identity", help="only this identity, as EIP:PORT/PROTO (e.g. 172.18.0.10:80/tcp)")
    show.add_argument("--memory", action="store_true",
                      help="the running agent's memory instead: resident, peak, malloc's heap, and Python's objects "
                           "by file when it runs with PYTHONTRACEMALLOC=1 (JSON)")
    sub.add_parser("cleanup", help="remove everything the agent owns (its table); nothing else is touched")
    health = sub.add_parser("health", help="ask the running agent (exec probes): exit 0 if ready or live, 1 if not")
    which = health.add_mutually_exclusive_group(required=True)
    which.add_argument("--ready", action="store_true", help="the first full sync is done and nothing keeps it from serving")
    which.add_argument("--live", action="store_true", help="its loop is not wedged")
    health.add_argument("--state-dir", type=Path, default=Settings.state_dir, help="where its status socket is")
    health.add_argument("--timeout", type=float, default=1.0, help="seconds to wait for an answer")
    sup = sub.add_parser("supervise", help="run `natgw-agent ARGS...` and start it again at once when it dies "
                                           "(the agent container's main process)")
    sup.add_argument("args", nargs="*", help="the worker's arguments, e.g. --log-format json run (everything after "
                                             "`supervise` is the worker's)")
    inj = sub.add_parser("inject", help="the admission webhook adding the agent to kube-ovn gateway pods")
    inj.add_argument("--listen", default=":8443", help="host:port to serve HTTPS on")
    inj.add_argument("--tls-cert", required=True, help="certificate (PEM) the API server trusts")
    inj.add_argument("--tls-key", required=True)
    inj.add_argument("--agent-image", default=os.environ.get("NATGW_AGENT_IMAGE", ""),
                     help="image of the agent container (default: $NATGW_AGENT_IMAGE)")
    inj.add_argument("--service-account", default=InjectOptions.service_account,
                     help="given to gateway pods that have none")
    inj.add_argument("--api-host", default="", help="KUBERNETES_SERVICE_HOST for the agent, if it must differ")
    inj.add_argument("--api-port", default="", help="KUBERNETES_SERVICE_PORT for the agent, if it must differ")
    inj.add_argument("--agent-arg", action="append", default=[], help="another argument of `natgw-agent run`")
    inj.add_argument("--api-network", default="", help="attach gateway pods to this NAD (namespace/name) to reach "
                                                       "the API, as kube-ovn does only with its BGP speaker")
    inj.add_argument("--api-route", action="append", default=[], metavar="DST=GW",
                     help="a route through --api-network, e.g. 10.96.0.1/32=100.64.0.1")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    worker: list[str] = []
    if "supervise" in argv:  # everything after it is the worker's, options included
        at = argv.index("supervise")
        argv, worker = argv[:at + 1], argv[at + 1:]
    args = _parser().parse_args(argv)
    logsetup.configure(args.log_format, args.log_level)
    if args.command == "supervise":
        args.args = worker
        if not args.args:
            print("natgw-agent supervise: which command to run? e.g. `supervise --log-format json run`", file=sys.stderr)
            return 2
        return supervise(args.args)
    if args.command == "health":
        return _health(args.state_dir / "agent.sock", "ready" if args.ready else "live", args.timeout)
    if args.command == "inject":
        return _inject(args)
    if args.command == "show" and args.memory:
        try:
            print(json.dumps(query(args.state_dir / "agent.sock", "memory", timeout=30.0), indent=2))
        except (OSError, ValueError) as err:
            print(f"natgw-agent: no agent answered at {args.state_dir / 'agent.sock'}: {err}", file=sys.stderr)
            return 1
        return 0
    if args.command == "show":
        try:
            found = inspect(KernelView("ip", args.table, subscribe=False), args.identity)
        except (NetlinkError, OSError) as err:
            print(f"natgw-agent: cannot read the table: {err}", file=sys.stderr)
            return 1
        sys.stdout.write(format_show(found, args.json, _agent_status(args.state_dir / "agent.sock")))
        return 0
    if args.command == "cleanup":
        return _cleanup(args.table)
    if not args.gateway:
        print("natgw-agent: no gateway name: --gateway not given and GATEWAY_NAME empty (in a gateway pod it comes "
              f"from the pod annotation {GATEWAY_ANNOTATION} through the downward API: "
              f"metadata.annotations['{GATEWAY_ANNOTATION}'])", file=sys.stderr)
        return 2
    settings = Settings(gateway=args.gateway, from_dir=args.from_dir, kubeconfig=args.kubeconfig, table=args.table,
                        token_dir=args.token_dir, hairpin_snat=args.hairpin_snat, vpc_interface=args.vpc_interface,
                        hairpin_mark=args.hairpin_mark,
                        **({"event_namespace": args.event_namespace, "metrics_addr": args.metrics_addr,
                            "take_over_legacy": args.take_over_legacy, "state_dir": args.state_dir}
                           if args.command == "run" else {}))
    api = None if settings.from_dir is not None else _api_client(settings)
    source: Source
    if api is None:
        from agent.sources.directory import DirectorySource  # and PyYAML with it: 1 MB the Kubernetes path does without

        source = DirectorySource(settings.from_dir, settings.poll_interval)
    else:
        from agent.sources.kube import KubeSource  # the kubernetes client only where it is used: ~16 MB

        source = KubeSource(api, settings.watch)
    if args.command in ("render", "diff"):
        return _render(settings, source, wait=0 if api is None else 30, mode=args.command, text=getattr(args, "text", False),
                       state_dir=getattr(args, "state_dir", None))
    return _run(settings, source, api)


def _cleanup(table: str) -> int:
    """Delete the agent's table: its rules, maps and affinity sets. Flows already set up
    keep their conntrack entries; new connections fall through to whatever else is there."""
    try:
        if KernelView("ip", table, subscribe=False).read() is None:
            print(f"natgw-agent: no table ip {table}: nothing to remove")
            return 0
        Nft("ip", table).apply(one_transaction([{"delete": {"table": {"family": "ip", "name": table}}}]))
    except (ApplyError, NetlinkError) as err:
        print(f"natgw-agent: cleanup failed: {err}", file=sys.stderr)
        return 1
    print(f"natgw-agent: removed table ip {table}")
    return 0


def _agent_status(path: Path) -> dict[str, Any] | None:
    """The running agent's status (capabilities, problems), None if none answers."""
    try:
        return query(path, "status")
    except (OSError, ValueError):
        return None


def _health(path: Path, what: str, timeout: float) -> int:
    """An exec probe: asks the agent's status socket, never the kernel or the network."""
    try:
        answer = query(path, what, timeout)
    except (OSError, ValueError) as err:
        print(f"natgw-agent health: no answer from {path}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(answer))
    return 0 if answer.get("ok") else 1


def _inject(args: argparse.Namespace) -> int:
    if not args.agent_image:
        print("natgw-agent inject: --agent-image (or NATGW_AGENT_IMAGE) is required", file=sys.stderr)
        return 2
    routes = tuple(tuple(r.split("=", 1)) for r in args.api_route)
    if any(len(r) != 2 or not all(r) for r in routes) or (routes and not args.api_network):
        print("natgw-agent inject: --api-route takes DST=GW, and needs --api-network", file=sys.stderr)
        return 2
    options = InjectOptions(image=args.agent_image, service_account=args.service_account, api_host=args.api_host,
                            api_port=args.api_port, extra_args=tuple(args.agent_arg), api_network=args.api_network,
                            api_routes=routes)  # type: ignore[arg-type]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = webhook.serve(host_port(args.listen), args.tls_cert, args.tls_key, options)
    structlog.get_logger().info("admission webhook serving", address=args.listen, image=args.agent_image)
    stop.wait()
    server.shutdown()
    return 0


def _api_client(settings: Settings) -> Any:
    from agent.sources.kubeapi import api_client  # the kubernetes client only where it is used: ~10 MB

    return api_client(settings.kubeconfig, settings.token_dir)


def _check_crd(api: Any, health: Health, events: Any, settings: Settings) -> CrdCheck:
    """Keep the IptablesDnatRule CRD checked from a thread of its own (agent/run/crdcheck.py):
    not ready, loudly, when its schema lacks what the agent needs or until one read
    succeeds."""
    return CrdCheck(crd_reader(api), health, events, settings.gateway).start()


def _diff_capabilities(state_dir: Path, table: str) -> Capabilities:
    """What a sync would use: the running agent's probed capabilities, else a probe of its
    own in a private namespace (agent/kernel/privateprobe.py); RuntimeError if neither."""
    found = from_status(_agent_status(state_dir / "agent.sock"))
    if found is not None:
        return found
    try:
        return probe_private(table)
    except RuntimeError as err:
        raise RuntimeError(f"no agent answered at {state_dir / 'agent.sock'} and the probe in a private network "
                           f"namespace failed ({err}): give --state-dir of the running agent, or run as root") from err


def _render(settings: Settings, source: Source, wait: float, mode: str, text: bool,
            state_dir: Path | None = None) -> int:
    caps = None
    if mode == "diff":
        try:
            caps = _diff_capabilities(state_dir or settings.state_dir, settings.table)
        except RuntimeError as err:
            print(f"natgw-agent diff: {err}", file=sys.stderr)
            return 1
    source.start()
    deadline = time.monotonic() + wait
    while not (source.poll() or source.ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    source.stop()
    if not source.ready:
        print(f"natgw-agent: could not read the rules (waited {wait:.0f}s)", file=sys.stderr)
        return 1
    desired, _ = evaluate(source.objects(), settings, Reporter())
    if caps is not None:
        # Against the kernel, with the kernel's slots and the probed capabilities (one JSON
        # transaction on nft >= 1.1): exactly what a sync would send now.
        kernel = KernelView("ip", settings.table, subscribe=False).read()
        wanted = render(desired.services, kernel or EMPTY, settings.affinity_set_size, settings.priority,
                        hairpin_of(settings))
        todo = plan(kernel, wanted, "ip", settings.table, text_maps=not caps.json_concat_maps)
        sys.stdout.write(document(todo.commands) if todo else "")
        return 1 if todo else 0
    wanted = render(desired.services, EMPTY, settings.affinity_set_size, settings.priority, hairpin_of(settings))
    doc = document(plan(None, wanted, "ip", settings.table).commands)
    if text:
        try:
            doc = to_text(doc)
        except (RuntimeError, OSError) as err:
            print(f"natgw-agent: render --text needs root (a private network namespace): {err}", file=sys.stderr)
            return 1
    sys.stdout.write(doc)
    return 0


def _run(settings: Settings, source: Source, api: Any) -> int:
    stop = StopEvent()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # The rules stay in the kernel: the data plane outlives the process.
        signal.signal(sig, lambda *_: stop.set())
    log = structlog.get_logger()
    log.info("starting", gateway=settings.gateway, table=settings.table,
             source=str(settings.from_dir) if settings.from_dir else "kubernetes")
    events = None
    if api is not None:
        from agent.sources.events import EventRecorder

        events = EventRecorder(api, settings.event_namespace, host=settings.gateway)
    health = Health(settings.healthz_stale_after, settings.livez_wedged_after)
    metrics = Metrics()
    # Counters through a read-only view of their own (its own socket: another thread).
    metrics.serve_backend_counters(KernelView("ip", settings.table, subscribe=False).counters)
    reconciler = connected(settings, Reporter(events, settings.gateway))
    if api is not None:
        _check_crd(api, health, events, settings)
    try:
        status: StatusServer | None = StatusServer(settings.state_dir / "agent.sock", health.answer(reconciler.caps))
    except OSError as err:  # `natgw-agent health` will say so; the data plane is programmed all the same
        log.error("status socket unavailable", path=str(settings.state_dir / "agent.sock"), error=str(err))
        status = None
    try:
        server = serve(health, settings.metrics_addr, metrics)
    except OSError as err:  # a taken port must not keep the data plane from being programmed
        log.error("health endpoints unavailable", address=settings.metrics_addr, error=str(err))
        server = None
    if events is not None:
        events.start()
    source.start()
    try:
        run_loop(settings, source, reconciler, stop, health, metrics)
    finally:
        if status is not None:
            status.close()
        source.stop()
        if events is not None:
            events.stop()
        if server is not None:
            server.shutdown()
    log.info("stopped; rules left in place")
    return 0


if __name__ == "__main__":
    sys.exit(main())
