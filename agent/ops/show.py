"""`natgw-agent show`: the data plane as the kernel holds it (read back, not from memory),
one block per identity, with per-backend counters and pinned-client counts."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from agent.kernel.nfnetlink import NetlinkError
from agent.kernel.view import KernelView
from agent.core.layout import backend_counters, goto_target, parse_target, pinned_clients, served, slots_of
from agent.core.model import Backend
from agent.ops.status import agent_status, query


def show(table: str, only: str | None, as_json: bool, sock: Path) -> int:
    """`natgw-agent show`: the kernel's table read back, with the running agent's status
    (asked at `sock`) when one answers."""
    try:
        found = inspect(KernelView("ip", table, subscribe=False), only)
    except (NetlinkError, OSError) as err:
        print(f"natgw-agent: cannot read the table: {err}", file=sys.stderr)
        return 1
    sys.stdout.write(format_show(found, as_json, agent_status(sock)))
    return 0


def show_memory(sock: Path) -> int:
    """`natgw-agent show --memory`: the running agent's own account of its memory (JSON)."""
    try:
        print(json.dumps(query(sock, "memory", timeout=30.0), indent=2))
    except (OSError, ValueError) as err:
        print(f"natgw-agent: no agent answered at {sock}: {err}", file=sys.stderr)
        return 1
    return 0


def inspect(view: KernelView, only: str | None = None) -> list[dict[str, Any]] | None:
    """Every identity the kernel serves (or the one named `only`, as EIP:PORT/PROTO), with
    its backends, their slots, counters and pinned clients; None if there is no table.
    One read of the table over netlink (elements, counters and affinity entries)."""
    state = view.read_state()
    if state is None:
        return None
    ruleset = state.ruleset()
    counters = backend_counters(state.elements, state.counters)
    pinned = pinned_clients({name: [key for key, _ in entries] for name, entries in state.entries.items()})
    slots = slots_of(ruleset)
    found = []
    for identity, elem in served(ruleset):
        if only is not None and str(identity) != only:
            continue
        target = goto_target(elem) or "?"
        parsed = parse_target(target)
        held: dict[Backend, int] = slots.get(identity, {})
        found.append({
            "identity": str(identity),
            "affinity": None if parsed is None else ("ClientIP" if parsed[0] else "None"),
            "timeout": parsed[1] if parsed and parsed[0] else None,
            "chain": target,
            "rules": (elem.comment or "").split(",") if elem.comment else [],
            "backends": [
                {"backend": str(backend), "slot": slot,
                 "packets": counters.get((str(identity), str(backend)), (0, 0))[0],
                 "bytes": counters.get((str(identity), str(backend)), (0, 0))[1],
                 "pinned_clients": pinned.get((identity, slot), 0) if parsed and parsed[0] else None}
                for backend, slot in sorted(held.items(), key=lambda kv: kv[1])
            ],
        })
    return found


def format_show(found: list[dict[str, Any]] | None, as_json: bool = False, agent: dict[str, Any] | None = None) -> str:
    """`agent`: the running agent's status (its capabilities and problems), if one answered."""
    if as_json:
        return json.dumps({"identities": found, "agent": agent}, indent=2) + "\n"
    head = _agent_lines(agent)
    if found is None:
        return head + "no natgw table: the agent has programmed nothing in this namespace\n"
    blocks: list[str] = []
    for ident in found:
        if ident["affinity"] is None:
            mode = f"unknown target {ident['chain']}"
        elif ident["affinity"] == "ClientIP":
            mode = f"affinity ClientIP timeout {ident['timeout']}s"
        else:
            mode = "affinity none (random)"
        lines = [f"{ident['identity']}  {mode}", f"  rules: {','.join(ident['rules']) or '-'}"]
        if not ident["backends"]:
            lines.append("  backends: none")
        total = sum(b["packets"] for b in ident["backends"]) or 1
        for b in ident["backends"]:
            share = f"{100 * b['packets'] / total:.0f}%"
            pins = "" if b["pinned_clients"] is None else f"  pinned clients {b['pinned_clients']}"
            lines.append(f"  -> {b['backend']}  slot {b['slot']}  new connections {b['packets']} ({share}){pins}")
        blocks.append("\n".join(lines))
    return head + ("\n\n".join(blocks) + "\n" if blocks else "no identities programmed\n")


def _agent_lines(agent: dict[str, Any] | None) -> str:
    if agent is None:
        return "agent: not answering (not running here, or another --state-dir)\n\n"
    caps = agent.get("capabilities", {})
    lines = [f"agent: {'ready' if agent.get('ready') else 'NOT READY'}; nftables {caps.get('nft_version', '?')}"
             f" (JSON declares concatenated maps: {'yes' if caps.get('json_concat_maps') else 'no'},"
             f" destroy: {'yes' if caps.get('destroy') else 'no'}), kernel {caps.get('kernel', '?')}"]
    mem = agent.get("memory") or {}
    if mem.get("rss_kib") is not None:
        lines.append(f"  memory: resident {mem['rss_kib'] / 1024:.0f} MB, peak {mem['peak_kib'] / 1024:.0f} MB")
    lines += [f"  problem: {p}" for p in agent.get("problems", [])]
    return "\n".join(lines) + "\n\n"
