"""The daemon's wiring (`natgw-agent run`): the one place that makes its I/O objects (the
kernel's writer and views, conntrack, the API client, the status socket, the HTTP
endpoints) and hands them to the parts that use them; nothing below builds its own."""
from __future__ import annotations

import platform
import signal
from typing import Any, Callable

import structlog

from agent.core.legacy import LEGACY_TABLE
from agent.kernel.caps import Capabilities
from agent.kernel.nft import Nft
from agent.kernel.view import KernelView
from agent.ops.health import Health, serve
from agent.ops.metrics import Metrics
from agent.ops.report import Reporter
from agent.ops.status import PROGRAMMED, StatusServer
from agent.run.checks import HealthChecks
from agent.run.cleanup import Cleanup, FlowTable, SetReader
from agent.run.crdcheck import CrdCheck, reader as crd_reader
from agent.run.loop import Source, StopEvent, run_loop
from agent.run.planner import CHECK_SETTINGS, FAMILY, TABLE_SETTINGS, Planner, reported
from agent.run.reconcile import Reconciler, View
from agent.settings import Settings

log = structlog.get_logger()


def assemble(settings: Settings, nft: Nft, view: View, caps: Capabilities, reporter: Reporter,
             flow_table: Callable[[], FlowTable] | None, set_reader: Callable[[], SetReader]) -> Reconciler:
    """A reconciler and its collaborators, each made once: the planner holds the desired
    state, which the cleanup thread asks for an identity's backends; `flow_table` and
    `set_reader` make the cleanup thread's own kernel connections, in its thread."""
    planner = Planner(settings, caps)
    cleanup = Cleanup(planner.backends, flow_table, set_reader, settings.cleanup_slice)
    return Reconciler(settings, nft, view, planner, cleanup, reporter)


def connected(settings: Settings, reporter: Reporter | None = None) -> Reconciler:
    """A reconciler on this network namespace's kernel: libnftables to write, its own
    netlink to read and follow changes, the capabilities probed (and logged)."""
    from agent.kernel.caps import probe
    from agent.kernel.ctnetlink import Conntrack

    view = KernelView(FAMILY, settings.table, also=(LEGACY_TABLE,) if settings.take_over_legacy else ())
    nft = Nft(FAMILY, settings.table)
    caps = probe(nft, view, FAMILY, settings.table)
    log.info("capabilities", **caps.as_dict())
    # The cleanup thread's own sockets, made in its thread (so in this namespace too).
    return assemble(settings, nft, view, caps, reporter or Reporter(), Conntrack if settings.conntrack else None,
                    lambda: KernelView(FAMILY, settings.table, subscribe=False))


def connect_api(settings: Settings) -> Any:
    from agent.sources.kubeapi import api_client  # the kubernetes client only where it is used: ~10 MB

    return api_client(settings.kubeconfig, settings.token_dir)


def source_of(settings: Settings) -> tuple[Source, Any]:
    """Where the rules come from: the directory given (--from-dir), else the Kubernetes API;
    with the API client (None for a directory)."""
    if settings.from_dir is not None:
        from agent.sources.directory import DirectorySource  # and PyYAML with it: 1 MB the Kubernetes path does without

        return DirectorySource(settings.from_dir, settings.poll_interval), None
    from agent.sources.kube import KubeSource  # the kubernetes client only where it is used: ~16 MB

    api = connect_api(settings)
    return KubeSource(api, settings.watch), api


def check_crd(api: Any, health: Health, events: Any, settings: Settings) -> CrdCheck:
    """Keep the IptablesDnatRule CRD checked from a thread of its own (agent/run/crdcheck.py):
    not ready, loudly, when its schema lacks what the agent needs or until one read
    succeeds."""
    return CrdCheck(crd_reader(api), health, events, settings.gateway).start()


def health_checks(settings: Settings) -> HealthChecks:
    """The backends' health checks: a prober thread in this namespace (the gateway's: the
    checks go where the traffic goes), started by the loop. Made even with
    settings.health_checks off: a rule's annotation may still ask for one."""
    from agent.health.prober import Prober

    return HealthChecks(lambda report: Prober(report, budget=settings.health_cpu_budget),
                        remember=settings.state_dir / "health-down.json")


def run(settings: Settings) -> int:
    """Program the gateway and keep it programmed until SIGTERM or SIGINT."""
    source, api = source_of(settings)
    stop = StopEvent()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # The rules stay in the kernel: the data plane outlives the process.
        signal.signal(sig, lambda *_: stop.set())
    # The nftables it runs on comes with the capabilities it probes (their log line).
    log.info("starting", gateway=settings.gateway, table=settings.table,
             source=str(settings.from_dir) if settings.from_dir else "kubernetes", python=platform.python_version(),
             masquerade=settings.vpc_interface if settings.masquerade else False)
    events = None
    if api is not None:
        from agent.sources.events import EventRecorder

        events = EventRecorder(api, settings.event_namespace, host=settings.gateway)
    health = Health(settings.healthz_stale_after, settings.livez_wedged_after,
                    programmed=settings.state_dir / PROGRAMMED)
    metrics = Metrics()
    metrics.masquerade.set(1 if settings.masquerade else 0)
    # Counters through a read-only view of their own (its own socket: another thread).
    metrics.serve_backend_counters(KernelView(FAMILY, settings.table, subscribe=False).counters)
    reconciler = connected(settings, Reporter(events, settings.gateway))
    checks = health_checks(settings)
    checked_as = reported(settings, CHECK_SETTINGS)  # in the status too: `diff` plans with them
    if api is not None:
        check_crd(api, health, events, settings)
    try:
        status: StatusServer | None = StatusServer(settings.state_dir / "agent.sock", health.answer(
            reconciler.caps, lambda: {**checks.snapshot(), "settings": checked_as},
            reported(settings, TABLE_SETTINGS)))
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
        run_loop(settings, source, reconciler, stop, health, metrics, checks, events)
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
