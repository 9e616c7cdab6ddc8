"""`natgw-agent show`: the data plane as the kernel holds it (read back, not from memory),
one block per identity, with per-backend counters and pinned-client counts."""
from __future__ import annotations

import json
from typing import Any

from agent.layout import affinity_sets, counters_of, goto_target, parse_target, pinned_clients, served, slots_of
from agent.model import Backend
from agent.nft import Nft
from agent.ruleset import from_listing


def inspect(nft: Nft, only: str | None = None) -> list[dict[str, Any]] | None:
    """Every identity the kernel serves (or the one named `only`, as EIP:PORT/PROTO), with
    its backends, their slots, counters and pinned clients; None if there is no table."""
    listing = nft.listing()
    if listing is None:
        return None
    ruleset, counters = from_listing(listing), counters_of(listing)
    pinned = pinned_clients({name: nft.set_elements(name) for name in affinity_sets(ruleset)})
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


def format_show(found: list[dict[str, Any]] | None, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(found, indent=2) + "\n"
    if found is None:
        return "no natgw table: the agent has programmed nothing in this namespace\n"
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
    return "\n\n".join(blocks) + "\n" if blocks else "no identities programmed\n"
