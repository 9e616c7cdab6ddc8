"""`natgw-agent show`: the data plane as the kernel holds it (read back, not from memory),
one block per identity, with per-backend counters and pinned-client counts."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from agent.kernel.nfnetlink import NetlinkError
from agent.kernel.nftread import TableState
from agent.kernel.view import KernelView
from agent.core.consistent import bucket, choose
from agent.core.layout import (CHASH, SNAT_CHAIN, affinity_set, backend_counters, goto_target, identity_key,
                               parse_target, pinned_clients, served, slots_of, sticky_slot)
from agent.core.model import Backend, Identity
from agent.core.ruleset import Elem, ElemKey
from agent.ops.status import agent_status, query


def show(table: str, only: str | None, as_json: bool, sock: Path, client: str | None = None) -> int:
    """`natgw-agent show`: the kernel's table read back, with the running agent's status
    (asked at `sock`) when one answers."""
    try:
        state = KernelView("ip", table, subscribe=False).read_state()
    except (NetlinkError, OSError) as err:
        print(f"natgw-agent: cannot read the table: {err}", file=sys.stderr)
        return 1
    found = inspect(state, only, client) if state is not None else None
    snat = masquerading(state.rules) if state is not None else None
    sys.stdout.write(format_show(found, as_json, agent_status(sock), snat))
    return 0


def show_memory(sock: Path) -> int:
    """`natgw-agent show --memory`: the running agent's own account of its memory (JSON)."""
    try:
        print(json.dumps(query(sock, "memory", timeout=30.0), indent=2))
    except (OSError, ValueError) as err:
        print(f"natgw-agent: no agent answered at {sock}: {err}", file=sys.stderr)
        return 1
    return 0


def inspect(state: TableState, only: str | None = None, client: str | None = None) -> list[dict[str, Any]]:
    """Every identity the kernel serves (or the one named `only`, as EIP:PORT/PROTO), with
    its backends, their slots, counters and pinned clients, from one read of the table over
    netlink (elements, counters and affinity entries). With `client` (an address), where
    that client's next connection would go."""
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
        if client is not None:
            found[-1]["client"] = reach(client, identity, parsed is not None and parsed[0], held,
                                        ruleset.elements.get(CHASH, {}).get(identity_key(identity)), state.entries)
    return found


def reach(client: str, identity: Identity, affinity: bool, held: dict[Backend, int], buckets: Any,
          entries: dict[str, list[tuple[ElemKey, int | None]]]) -> dict[str, Any]:
    """Where a new connection from `client` to this identity goes, as the kernel holds it:
    its pin if it has one, else the backend of its bucket in the chash map. `expected` is
    the consistent choice every replica computes from the backends alone (consistent.py):
    a replica whose table says otherwise is out of step."""
    answer: dict[str, Any] = {"address": client, "backend": None, "pinned": False}
    if not affinity:
        return {**answer, "how": "random per connection (no session affinity)"}
    by_slot = {slot: backend for backend, slot in held.items()}
    key = (client, *identity_key(identity))
    for slot, backend in sorted(by_slot.items()):
        for entry, expires_ms in entries.get(affinity_set(slot), ()):
            if entry == key:
                return {**answer, "backend": str(backend), "pinned": True, "expires_s": (expires_ms or 0) // 1000,
                        "how": f"pinned to slot {slot}"}
    expected = str(choose(held, client)) if held else None
    b = bucket(client)
    verdict = buckets[b] if isinstance(buckets, tuple) and b < len(buckets) else None
    slot = sticky_slot(goto_target(Elem(verdict))) if isinstance(verdict, dict) else None
    backend = by_slot.get(slot) if slot is not None else None
    how = f"bucket {b} of the consistent table" if backend else f"bucket {b}: not in the kernel (chosen at random)"
    return {**answer, "backend": str(backend) if backend else None, "how": how, "expected": expected}


def masquerading(rules: Mapping[str, tuple[dict[str, Any], ...]]) -> str | None:
    """The interface the table masquerades the agent's connections on (--masquerade), as
    the kernel holds it (its rules by chain); None if it does not. The rules alone, not
    state.ruleset(): inspect() builds that once, and it folds every bucket element."""
    for rule in rules.get(SNAT_CHAIN, ()):
        exprs = rule.get("expr", [])
        if exprs and "masquerade" in exprs[-1]:
            return next((m["match"]["right"] for m in exprs if m.get("match", {}).get("left") == _OIFNAME), "?")
    return None


_OIFNAME = {"meta": {"key": "oifname"}}


def format_show(found: list[dict[str, Any]] | None, as_json: bool = False, agent: dict[str, Any] | None = None,
                masquerade: str | None = None) -> str:
    """`agent`: the running agent's status (its capabilities and problems), if one answered;
    `masquerade`: the interface the kernel's table masquerades on (masquerading())."""
    if as_json:
        return json.dumps({"identities": found, "masquerade": masquerade, "agent": agent}, indent=2) + "\n"
    head = _agent_lines(agent)
    checks = _health_by_backend(agent)
    if found is None:
        return head + "no natgw table: the agent has programmed nothing in this namespace\n"
    head += (f"masquerade: on: connections leave {masquerade} from this replica's address (backends see it, "
             "not the client's)\n\n" if masquerade else "masquerade: off: backends see the client's address\n\n")
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
            lines.append(f"  -> {b['backend']}  slot {b['slot']}  new connections {b['packets']} ({share}){pins}"
                         + (_health_word(checks.get(b["backend"])) if checks else ""))
        if (c := ident.get("client")) is not None:
            lines.append(_client_line(c))
        blocks.append("\n".join(lines))
    return head + ("\n\n".join(blocks) + "\n" if blocks else "no identities programmed\n")


def _client_line(c: dict[str, Any]) -> str:
    line = f"  client {c['address']}: {c['backend'] or 'no backend chosen here'} ({c['how']}"
    if c["pinned"]:
        line += f", {c['expires_s']} s left"
    elif c.get("expected") and c["expected"] != c["backend"]:
        line += f"; OUT OF STEP: every replica's table says {c['expected']}"
    return line + ")"


def _health_by_backend(agent: dict[str, Any] | None) -> dict[str, list[dict[str, Any]]]:
    """The agent's health targets by the backend they check (a backend may have two checks)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for row in ((agent or {}).get("health") or {}).get("targets", []):
        found.setdefault(row["backend"], []).append(row)
    return found


def _health_word(rows: list[dict[str, Any]] | None) -> str:
    if not rows:
        return "  not checked"
    return "".join(f"  {'up' if r['up'] else 'DOWN'} since {_clock(r['since'])} ({r['check'].split()[0]})" for r in rows)


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _health_lines(health: dict[str, Any] | None) -> list[str]:
    """The checks in brief, and every backend that is down or failed a check lately: why,
    since when. A down backend is in no identity's block below: it left the table."""
    if not health:
        return []
    rows = health.get("targets", [])
    down = [r for r in rows if not r["up"]]
    stretch = health.get("stretch", 1.0)
    lines = [f"  health checks: {len(rows) - len(down)} up, {len(down)} down"
             + (f"; intervals stretched x{stretch:.1f} to keep the CPU budget" if stretch > 1.0 else "")]
    if health.get("failOpen"):
        lines.append(f"    every backend down, all kept (fail open): {', '.join(health['failOpen'][:20])}")
    recovered = 0
    for r in sorted(rows, key=lambda r: (r["up"], -r.get("failedAt", 0))):
        if r["up"] and (not r.get("lastFailure") or recovered == 10):  # the 10 latest that failed and recovered
            continue
        recovered += r["up"]
        state = f"DOWN since {_clock(r['since'])}" if not r["up"] else "up"
        lines.append(f"    {r['backend']} {state} ({r['check']}); last failure {_clock(r['failedAt'])}: {r['lastFailure']}")
    return lines


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
    lines += _health_lines(agent.get("health"))
    return "\n".join(lines) + "\n\n"
