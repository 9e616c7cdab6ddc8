"""Run inside a fresh network namespace: the kernel view deaf to the agent's own large
transactions (KernelView.deaf). Prints one JSON object of what it saw."""
from __future__ import annotations

import json
import subprocess
from typing import Any

from agent.kernel.view import NONE, KernelView
from agent.kernel.nft import Nft
from agent.core.plan import one_transaction

REF = {"family": "ip", "table": "natgw"}


def chain(name: str) -> Any:
    return one_transaction([{"add": {"chain": {**REF, "name": name}}}])


def others(text: str) -> None:
    subprocess.run(["nft", text], check=True)  # another process: another netlink port


def main() -> None:
    nft = Nft("ip", "natgw")
    nft.apply(one_transaction([{"add": {"table": {"family": "ip", "name": "natgw"}}}]))
    view = KernelView("ip", "natgw")
    out: dict[str, Any] = {}

    with view.deaf(lambda: nft.transactions):
        nft.apply(chain("own"))
    out["quiet_nothing_queued"] = not view._sub.wait(0)  # the kernel sent nothing at all
    out["quiet_is_none"] = view.damage() == NONE

    with view.deaf(lambda: nft.transactions):
        nft.apply(chain("own2"))
        others("add chain ip natgw theirs")
    out["others_everything"] = view.damage().everything

    with view.deaf(lambda: nft.transactions):
        others("add table ip elsewhere")
    out["other_table_everything"] = view.damage().everything  # cannot tell which table: read back

    others("add chain ip natgw after")
    damage = view.damage()
    out["after_heard"] = damage.chains == frozenset({"after"}) and not damage.everything
    print(json.dumps(out))


if __name__ == "__main__":
    main()
