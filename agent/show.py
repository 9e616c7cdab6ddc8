"""`natgw-agent show`: the data plane as the kernel holds it (read back, not from memory),
one block per identity."""
from __future__ import annotations

from agent.model import Backend
from agent.render import SERVICES, addr_map, key_identity, parse_target, slots_of
from agent.ruleset import Ruleset


def format_show(ruleset: Ruleset | None) -> str:
    if ruleset is None:
        return "no natgw table: the agent has programmed nothing in this namespace\n"
    slots = slots_of(ruleset)
    blocks: list[str] = []
    for key, elem in sorted(ruleset.elements.get(SERVICES, {}).items(), key=lambda kv: key_identity(kv[0])):
        identity = key_identity(key)
        target = elem.value.get("goto", {}).get("target", "?") if isinstance(elem.value, dict) else "?"
        parsed = parse_target(target)
        if parsed is None:
            mode = f"unknown target {target}"
        elif parsed[0]:
            mode = f"affinity ClientIP timeout {parsed[1]}s"
        else:
            mode = "affinity none (random)"
        held: dict[Backend, int] = slots.get(identity, {})
        lines = [f"{identity}  {mode}", f"  rules: {elem.comment or '-'}"]
        if not held:
            lines.append("  backends: none")
        for backend, slot in sorted(held.items(), key=lambda kv: kv[1]):
            comment = ruleset.elements[addr_map(slot)][key].comment or "-"
            lines.append(f"  -> {backend}  slot {slot}  rules: {comment}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else "no identities programmed\n"
