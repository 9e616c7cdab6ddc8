"""Run inside a fresh network namespace: program the examples, then sync them again with
a new affinity set size and base chain priority (what a settings change or an upgrade
does). Prints one JSON line: the transactions it took, whether the kernel then equals the
mirror, and the declarations and elements the kernel holds before and after."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.dirsource import DirectorySource  # noqa: E402
from agent.nft import Nft  # noqa: E402
from agent.plan import plan  # noqa: E402
from agent.reconcile import Reconciler  # noqa: E402
from agent.settings import Settings  # noqa: E402


def main() -> None:
    source = DirectorySource(ROOT / "examples")
    source.poll()
    nft = Nft("ip", "natgw")
    Reconciler(Settings(gateway="gw1", conntrack=False), nft).sync(source.objects())
    before = nft.read()
    first = nft.transactions
    changed = Settings(gateway="gw1", conntrack=False, affinity_set_size=1024, priority=-161)
    reconciler = Reconciler(changed, nft)
    reconciler.sync(source.objects())
    after = nft.read()
    assert before is not None and after is not None and reconciler.mirror is not None
    print(json.dumps({
        "transactions": nft.transactions - first,
        "converged": plan(after, reconciler.mirror, "ip", "natgw") == [],
        "sets_before": before.sets, "sets_after": after.sets,
        "prio": after.chains["prerouting"]["prio"],
        "elements_kept": {n: len(e) for n, e in before.elements.items()} == {n: len(e) for n, e in after.elements.items()},
    }))


if __name__ == "__main__":
    main()
