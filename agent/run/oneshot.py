"""The one-shot commands: `render` (the desired state as the nft JSON it would send,
touching nothing), `diff` (what a sync would send to this kernel now) and `cleanup` (the
agent's table removed). render and diff plan through the reconciler's own Planner
(agent/run/planner.py), so what they print is what a sync sends."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from agent.core.commands import Table
from agent.core.desired import ListCatalog
from agent.core.health import load
from agent.core.model import Backend
from agent.core.plan import document, one_transaction
from agent.errors import ApplyError
from agent.kernel.caps import UNPROBED, Capabilities
from agent.kernel.nfnetlink import NetlinkError
from agent.kernel.nft import Nft
from agent.kernel.nfttext import to_text
from agent.kernel.privateprobe import from_status, probe_private
from agent.kernel.view import KernelView
from agent.ops.report import Reporter
from agent.ops.status import agent_status
from agent.run.daemon import source_of
from agent.run.loop import Source
from agent.run.planner import CHECK_SETTINGS, FAMILY, TABLE_SETTINGS, Planner, with_reported
from agent.settings import Settings

KUBE_WAIT = 30.0  # seconds for the API's first list; a directory is read at once


def render(settings: Settings, text: bool) -> int:
    """Print what a sync would send to an empty table (nft text with `text`: root)."""
    source, api = source_of(settings)
    catalog = _read(source, 0 if api is None else KUBE_WAIT)
    if catalog is None:
        return 1
    doc = document(Planner(settings, UNPROBED).preview(catalog, None, Reporter()).commands)
    if text:
        try:
            doc = to_text(doc)
        except (RuntimeError, OSError) as err:
            print(f"natgw-agent: render --text needs root (a private network namespace): {err}", file=sys.stderr)
            return 1
    sys.stdout.write(doc)
    return 0


def diff(settings: Settings, state_dir: Path) -> int:
    """Print what a sync would send to this kernel now; exit 1 if anything."""
    source, api = source_of(settings)
    running = agent_status(state_dir / "agent.sock")
    try:
        caps = _diff_capabilities(running, state_dir, settings.table)
        health = (running or {}).get("health") or {}
        down = load(health.get("down") or [], Backend)
        settings = with_reported(settings, health.get("settings") or {}, CHECK_SETTINGS)
        settings = with_reported(settings, (running or {}).get("dataplane") or {}, TABLE_SETTINGS)
    except (RuntimeError, ValueError) as err:
        print(f"natgw-agent diff: {err}", file=sys.stderr)
        return 1
    catalog = _read(source, 0 if api is None else KUBE_WAIT)
    if catalog is None:
        return 1
    # Against the kernel, with the kernel's slots, the probed capabilities (one JSON
    # transaction on nft >= 1.1), the running agent's table settings (masquerade...) and
    # the backends its checks have down (checked as its settings say): exactly what a
    # sync would send now.
    kernel = KernelView(FAMILY, settings.table, subscribe=False).read()
    planner = Planner(settings, caps)
    planner.set_down(frozenset(down))
    todo = planner.preview(catalog, kernel, Reporter())
    sys.stdout.write(document(todo.commands) if todo else "")
    return 1 if todo else 0


def cleanup(table: str) -> int:
    """Delete the agent's table: its rules, maps and affinity sets. Flows already set up
    keep their conntrack entries; new connections fall through to whatever else is there."""
    try:
        if KernelView(FAMILY, table, subscribe=False).read() is None:
            print(f"natgw-agent: no table {FAMILY} {table}: nothing to remove")
            return 0
        Nft(FAMILY, table).apply(one_transaction([Table(FAMILY, table).delete()]))
    except (ApplyError, NetlinkError) as err:
        print(f"natgw-agent: cleanup failed: {err}", file=sys.stderr)
        return 1
    print(f"natgw-agent: removed table {FAMILY} {table}")
    return 0


def _read(source: Source, wait: float) -> ListCatalog | None:
    """The source's objects once it has read them all, within `wait` seconds (None: it
    could not; said on stderr)."""
    source.start()
    deadline = time.monotonic() + wait
    while not (source.poll() or source.ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    source.stop()
    if not source.ready:
        print(f"natgw-agent: could not read the rules (waited {wait:.0f}s)", file=sys.stderr)
        return None
    return ListCatalog(source.objects())


def _diff_capabilities(running: dict[str, Any] | None, state_dir: Path, table: str) -> Capabilities:
    """What a sync would use: the running agent's probed capabilities, else a probe of its
    own in a private namespace (agent/kernel/privateprobe.py); RuntimeError if neither."""
    found = from_status(running)
    if found is not None:
        return found
    try:
        return probe_private(table)
    except RuntimeError as err:
        raise RuntimeError(f"no agent answered at {state_dir / 'agent.sock'} and the probe in a private network "
                           f"namespace failed ({err}): give --state-dir of the running agent, or run as root") from err
