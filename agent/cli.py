"""Command line: run (the agent), render (desired state as nft JSON), show (the kernel).
The parser and the dispatch only: each command's body lives in the wing that does its job."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from agent import log as logsetup
from agent.core.consistent import address_bytes
from agent.deploy import webhook
from agent.deploy.inject import GATEWAY_ANNOTATION, Options as InjectOptions
from agent.deploy.supervise import ARGS_HELP, DESCRIPTION as SUPERVISE_DESCRIPTION, HELP_FLAGS, supervise
from agent.kernel.nft import IDENTIFIER
from agent.ops import show, status
from agent.run import daemon, oneshot
from agent.settings import Settings


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


def _client_address(value: str) -> str:
    try:
        address_bytes(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: not an IPv4 address (e.g. 198.51.100.7)") from None
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="natgw-agent", description=(
        "Program kube-ovn share DNAT rules (one EIP:port over many backends, optionally with ClientIP "
        "affinity) into the gateway's nftables table, and keep them programmed; or inspect, clean up, probe, "
        "supervise or inject the agent."))
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto")
    p.add_argument("--log-level", default="info")
    p.add_argument("--table", default=Settings.table, type=_table_name,
                   help="the nftables table (family ip) the agent owns (letters, digits, _)")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("run", "program and keep programming the gateway"),
                       ("render", "print the desired state as the nft JSON it would send, touching nothing"),
                       ("diff", "print what differs between the desired state and the kernel; exit 1 if anything")):
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("--gateway", default=os.environ.get("GATEWAY_NAME", ""), help="gateway name (default: $GATEWAY_NAME)")
        s.add_argument("--from-dir", type=Path, help="read rules from this directory instead of the Kubernetes API")
        s.add_argument("--kubeconfig", type=Path, help="kubeconfig for the API (default: in-cluster service account)")
        s.add_argument("--token-dir", type=Path, default=Path(os.environ["NATGW_TOKEN_DIR"]) if os.environ.get(
            "NATGW_TOKEN_DIR") else None, help="in-cluster token and ca.crt from here instead of the automount path "
                                              "(default: $NATGW_TOKEN_DIR)")
        s.add_argument("--hairpin-snat", action="store_true",
                       help="SNAT clients on the VPC side reaching an identity to its EIP, in the agent's own table "
                            "(outside Kubernetes; kube-ovn's gateway has its own hairpin rule)")
        s.add_argument("--masquerade", action="store_true",
                       help="SNAT every connection the agent DNATs, leaving by --vpc-interface, to this replica's "
                            "address there, so answers return through it (an HA gateway's replicas: kube-ovn routes "
                            "answers by a hash of the backend's address; backends then see the replica's address)")
        s.add_argument("--no-consistent-choice", dest="consistent_choice", action="store_false",
                       help="pick a ClientIP identity's backend for a new client at random, not by the table every "
                            "replica computes alike (saves 61 map elements per ClientIP identity; for gateways "
                            "of one replica)")
        s.add_argument("--no-health-checks", dest="health_checks", action="store_false",
                       help="check no backend unless its rule's annotation natgw.kube-ovn.io/health-check asks")
        for knob, kind, what in (("interval", float, "seconds between two checks of a backend"),
                                 ("timeout", float, "seconds a check may take"),
                                 ("rise", int, "passes in a row that bring a backend back"),
                                 ("fall", int, "failures in a row that take a backend out"),
                                 ("cpu-budget", float, "share of one core the checks may use")):
            attr = f"health_{knob.replace('-', '_')}"
            s.add_argument(f"--health-{knob}", dest=attr, type=kind, default=getattr(Settings, attr),
                           help=f"{what} (default: %(default)s)")
        s.add_argument("--vpc-interface", default=Settings.vpc_interface, type=_interface_name,
                       help="the gateway's VPC-side interface, for --hairpin-snat and --masquerade "
                            "(default: %(default)s)")
        s.add_argument("--masquerade-mark", default=Settings.masquerade_mark, type=_mark,
                       help="conntrack mark bits --masquerade sets on the connections the agent DNATs "
                            "(default: 0x%(default)x; the connection's mark, never the packet's)")
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
    text = "print what the kernel holds, one block per identity, with the running agent's health checks"
    show_cmd = sub.add_parser("show", help=text, description=text)
    show_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    show_cmd.add_argument("--state-dir", type=Path, default=Settings.state_dir,
                          help="where the running agent's status socket is (its capabilities and problems)")
    show_cmd.add_argument("--identity", help="only this identity, as EIP:PORT/PROTO (e.g. 172.18.0.10:80/tcp)")
    show_cmd.add_argument("--client", type=_client_address, metavar="ADDRESS",
                          help="also say which backend a new connection from this client address would reach, "
                               "and whether it is pinned")
    show_cmd.add_argument("--memory", action="store_true",
                          help="the running agent's memory instead: resident, peak, malloc's heap, and Python's objects "
                               "by file when it runs with PYTHONTRACEMALLOC=1 (JSON)")
    text = "remove everything the agent owns (its table); nothing else is touched (for a stopped agent)"
    sub.add_parser("cleanup", help=text, description=text)
    text = "ask the running agent (exec probes): exit 0 if ready, live or routable, 1 if not"
    health_cmd = sub.add_parser("health", help=text, description=text)
    which = health_cmd.add_mutually_exclusive_group(required=True)
    which.add_argument("--ready", action="store_true", help="the first full sync is done and nothing keeps it from serving")
    which.add_argument("--live", action="store_true", help="its loop is not wedged")
    which.add_argument("--routable", action="store_true",
                       help="this pod's data plane was programmed whole once (an HA replica's readiness: it stays "
                            "ready through API outages and worker restarts)")
    health_cmd.add_argument("--state-dir", type=Path, default=Settings.state_dir, help="where its status socket is")
    health_cmd.add_argument("--timeout", type=float, default=1.0, help="seconds to wait for an answer")
    sup = sub.add_parser("supervise", help="run `natgw-agent ARGS...` and start it again at once when it dies "
                                           "(the agent container's main process)", description=SUPERVISE_DESCRIPTION)
    sup.add_argument("args", nargs="*", metavar="ARGS", help=ARGS_HELP)
    text = "serve the admission webhook that adds the agent's container to kube-ovn gateway pods"
    inj = sub.add_parser("inject", help=text, description=text)
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
        if worker[:1] and worker[0] in HELP_FLAGS:  # the supervisor's own help, not a worker's
            argv.append(worker.pop(0))
    args = _parser().parse_args(argv)
    logsetup.configure(args.log_format, args.log_level)
    if args.command == "supervise":
        args.args = worker
        if not args.args:
            print("natgw-agent supervise: which command to run? e.g. `supervise --log-format json run`", file=sys.stderr)
            return 2
        return supervise(args.args)
    if args.command == "health" and args.routable:
        return status.routable(args.state_dir)
    if args.command == "health":
        return status.health(args.state_dir / "agent.sock", "ready" if args.ready else "live", args.timeout)
    if args.command == "inject":
        return webhook.run(listen=args.listen, tls_cert=args.tls_cert, tls_key=args.tls_key,
                           agent_image=args.agent_image, service_account=args.service_account,
                           api_host=args.api_host, api_port=args.api_port, agent_args=args.agent_arg,
                           api_network=args.api_network, api_routes=args.api_route)
    if args.command == "show" and args.memory:
        return show.show_memory(args.state_dir / "agent.sock")
    if args.command == "show":
        return show.show(args.table, args.identity, args.json, args.state_dir / "agent.sock", args.client)
    if args.command == "cleanup":
        return oneshot.cleanup(args.table)
    if not args.gateway:
        print("natgw-agent: no gateway name: --gateway not given and GATEWAY_NAME empty (in a gateway pod it comes "
              f"from the pod annotation {GATEWAY_ANNOTATION} through the downward API: "
              f"metadata.annotations['{GATEWAY_ANNOTATION}'])", file=sys.stderr)
        return 2
    settings = Settings(gateway=args.gateway, from_dir=args.from_dir, kubeconfig=args.kubeconfig, table=args.table,
                        token_dir=args.token_dir, hairpin_snat=args.hairpin_snat, vpc_interface=args.vpc_interface,
                        hairpin_mark=args.hairpin_mark, masquerade=args.masquerade,
                        masquerade_mark=args.masquerade_mark, consistent_choice=args.consistent_choice,
                        health_checks=args.health_checks, health_interval=args.health_interval,
                        health_timeout=args.health_timeout, health_rise=args.health_rise, health_fall=args.health_fall,
                        health_cpu_budget=args.health_cpu_budget,
                        **({"event_namespace": args.event_namespace, "metrics_addr": args.metrics_addr,
                            "take_over_legacy": args.take_over_legacy, "state_dir": args.state_dir}
                           if args.command == "run" else {}))
    if args.command == "render":
        return oneshot.render(settings, args.text)
    if args.command == "diff":
        return oneshot.diff(settings, args.state_dir)
    return daemon.run(settings)


if __name__ == "__main__":
    sys.exit(main())
