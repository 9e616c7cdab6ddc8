"""Run inside a fresh network namespace: program the examples, then sync them again with
a new affinity set size and base chain priority (`settings`: what a settings change does),
or load the examples as the previous layout held them (separate addr_/port_ maps) and
sync them with this one (`upgrade`). Prints one JSON line: the transactions the second
sync took, whether the kernel then equals the mirror, and the declarations and element
counts the kernel holds before and after."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.sources.directory import DirectorySource  # noqa: E402
from agent.kernel.caps import probe  # noqa: E402
from agent.kernel.view import KernelView  # noqa: E402
from agent.kernel.nft import Nft  # noqa: E402
from agent.core.plan import plan  # noqa: E402
from agent.ops.report import Reporter  # noqa: E402
from agent.run.daemon import assemble  # noqa: E402
from agent.core.layout import key_identity, slots_of  # noqa: E402
from agent.core.plan import one_transaction  # noqa: E402
from agent.settings import Settings  # noqa: E402


APP = ["172.18.0.10", "tcp", 443]  # the ClientIP identity of the examples
CLIENT = "192.168.100.7"


def _swapped(commands: list[dict], first: str, second: str, key: list) -> list[dict]:
    """The commands with the two maps' values for one key exchanged."""
    values = {}
    for c in commands:
        body = c.get("add", {}).get("element", {})
        for item in body.get("elem", []) if body.get("name") in (first, second) else []:
            if item[0]["elem"]["val"]["concat"] == key:
                values[body["name"]] = item
    values[first][1], values[second][1] = values[second][1], values[first][1]
    return commands


def main(mode: str) -> None:
    source = DirectorySource(ROOT / "examples")
    source.poll()
    nft, view = Nft("ip", "natgw"), KernelView("ip", "natgw")
    caps = probe(nft, view, "ip", "natgw")  # as the agent would: text declarations only where needed
    if mode == "upgrade":
        old = json.loads((ROOT / "netns-tests" / "fixtures" / "layout-addr-port.json").read_text())["nftables"]
        nft.apply(one_transaction(_swapped(old, "addr_0", "addr_2", APP)))  # slots out of order, as history leaves them
        nft.apply(one_transaction([{"add": {"element": {"family": "ip", "table": "natgw", "name": "aff_0",
                                                        "elem": [{"concat": [CLIENT, *APP]}]}}}]))  # a client pinned to slot 0
        changed = Settings(gateway="gw1", conntrack=False)
    else:
        assemble(Settings(gateway="gw1", conntrack=False), nft, view, caps, Reporter(), None, lambda: view).sync(source.objects())
        changed = Settings(gateway="gw1", conntrack=False, affinity_set_size=1024, priority=-161)
    before = view.read()
    first = nft.transactions
    reconciler = assemble(changed, nft, view, caps, Reporter(), None, lambda: view)
    reconciler.sync(source.objects())
    after = view.read()
    assert before is not None and after is not None and reconciler.mirror is not None
    print(json.dumps({
        "transactions": nft.transactions - first,
        "json_concat_maps": caps.json_concat_maps,
        "converged": not plan(after, reconciler.mirror, "ip", "natgw"),
        "sets_before": before.sets, "sets_after": after.sets,
        "prio": after.chains["prerouting"]["prio"],
        "app_slots": {str(b): slot for b, slot in slots_of(after).get(key_identity(tuple(APP)), {}).items()},
        "aff_0": [list(k) for k in view.entries("aff_0")],
        "elements_before": {n: len(e) for n, e in before.elements.items()},
        "elements_after": {n: len(e) for n, e in after.elements.items()},
    }))


if __name__ == "__main__":
    main(sys.argv[1])
