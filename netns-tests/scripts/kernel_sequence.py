"""Run inside a fresh network namespace: random edits, each followed by a partial sync
through the real libnftables, then the kernel read back and compared with the mirror.
Prints one JSON line: steps, partial syncs, mismatches (first few)."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.run.daemon import connected  # noqa: E402
from agent.settings import Settings  # noqa: E402
from tests.builders import eip  # noqa: E402
from tests.sources import EIPS, Store, apply_edit  # noqa: E402


def random_edit(rng: random.Random) -> tuple:
    kind = rng.choices(["rule", "drop-rule", "eip", "drop-eip"], weights=[12, 4, 1, 1])[0]
    if kind == "rule":
        return ("rule", rng.randrange(12), rng.choice(list(EIPS)), rng.choice([80, 443]), rng.choice(["tcp", "UDP"]),
                rng.randint(1, 6), rng.choice(["", "ClientIP"]), rng.choice([0, 60, 600]))
    if kind == "drop-rule":
        return ("drop-rule", rng.randrange(12))
    if kind == "eip":
        return ("eip", rng.choice(list(EIPS)), rng.choice(["gw1", "gw1", "gw2"]),
                rng.choice(["172.18.0.10", "172.18.0.20", "172.18.0.30"]))
    return ("drop-eip", rng.choice(list(EIPS)))


def main(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    store = Store()
    for name, address in EIPS.items():
        store.put(eip(name, address))
    reconciler = connected(Settings(gateway="gw1", conntrack=False, retire_delay=0.0))
    reconciler.sync(store, None)
    store.take()
    mismatches, partial = [], 0
    for step in range(steps):
        apply_edit(store, random_edit(rng))
        result = reconciler.sync(store, store.take())
        partial += 1
        reconciler.retire_chains()
        kernel = reconciler.view.read()
        if kernel is None or kernel.elements != reconciler.mirror.elements or kernel.sets != reconciler.mirror.sets \
                or {c: r for c, r in kernel.rules.items() if r} != {c: r for c, r in reconciler.mirror.rules.items() if r}:
            mismatches.append({"step": step, "commands": result.commands})
    print(json.dumps({"steps": steps, "partial": partial, "identities": len(reconciler.state.services),
                      "mismatches": mismatches[:5]}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
