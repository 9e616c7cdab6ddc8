"""Command line: run (the agent), render (desired state as nft JSON), show (the kernel)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

import structlog

from agent import log as logsetup
from agent.dirsource import DirectorySource
from agent.errors import ApplyError
from agent.nft import Nft
from agent.plan import document, plan
from agent.reconcile import Reconciler, run_loop
from agent.render import render
from agent.report import Reporter, evaluate
from agent.ruleset import EMPTY
from agent.settings import Settings
from agent.show import format_show


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="natgw-agent", description=__doc__)
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto")
    p.add_argument("--log-level", default="info")
    p.add_argument("--table", default=Settings.table, help="the nftables table (family ip) the agent owns")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("run", "program and keep programming the gateway"),
                       ("render", "print the desired state as the nft JSON it would send, touching nothing")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--gateway", default=os.environ.get("GATEWAY_NAME", ""), help="gateway name (default: $GATEWAY_NAME)")
        s.add_argument("--from-dir", type=Path, help="read rules from this directory instead of the Kubernetes API")
    sub.add_parser("show", help="print what the kernel holds, one block per identity")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logsetup.configure(args.log_format, args.log_level)
    if args.command == "show":
        try:
            sys.stdout.write(format_show(Nft("ip", args.table).read()))
        except ApplyError as err:
            print(f"natgw-agent: cannot read the table: {err.message}", file=sys.stderr)
            return 1
        return 0
    if not args.gateway:
        print("natgw-agent: --gateway or GATEWAY_NAME is required", file=sys.stderr)
        return 2
    if args.from_dir is None:
        print("natgw-agent: the Kubernetes source is not available yet; use --from-dir", file=sys.stderr)
        return 2
    settings = Settings(gateway=args.gateway, from_dir=args.from_dir, table=args.table)
    source = DirectorySource(args.from_dir)
    if args.command == "render":
        source.poll()
        desired, _ = evaluate(source.objects(), settings, Reporter())
        wanted = render(desired.services, EMPTY, settings.affinity_set_size, settings.priority)
        sys.stdout.write(document(plan(None, wanted, "ip", settings.table)))
        return 0
    return _run(settings, source)


def _run(settings: Settings, source: DirectorySource) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # The rules stay in the kernel: the data plane outlives the process.
        signal.signal(sig, lambda *_: stop.set())
    log = structlog.get_logger()
    log.info("starting", gateway=settings.gateway, source=str(settings.from_dir), table=settings.table)
    run_loop(settings, source, Reconciler(settings, Nft("ip", settings.table)), stop)
    log.info("stopped; rules left in place")
    return 0


if __name__ == "__main__":
    sys.exit(main())
