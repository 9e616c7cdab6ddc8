"""`render --text`: the nft text of a JSON document as the kernel itself would print it.

Run in a private, empty network namespace (`unshare --net`): the document is applied
there and listed back, so the text is exactly what `nft list table` will show once the
agent applies it, and nothing of the caller's namespace is touched."""
from __future__ import annotations

import json
import sys

from agent.kernel.privatens import run_private


def to_text(document: str) -> str:
    """The kernel's text for this JSON document (needs root for the private namespace)."""
    return run_private("agent.kernel.nfttext", input=document, timeout=120)


def _main() -> int:
    import nftables

    from agent.errors import ApplyError
    from agent.kernel.nft import Nft
    from agent.core.plan import phased

    doc = json.loads(sys.stdin.read())
    table = next(c["add"]["table"] for c in doc["nftables"] if "table" in c.get("add", {}))
    try:
        Nft(table["family"], table["name"]).apply(phased(doc["nftables"], table["family"], table["name"]))  # as the agent applies it
    except ApplyError as err:
        print(err, file=sys.stderr)
        return 1
    nft = nftables.Nftables()
    nft.set_json_output(False)
    nft.set_stateless_output(True)  # no counter values: the same text before and after traffic
    rc, out, err = nft.cmd(f"list table {table['family']} {table['name']}")
    sys.stdout.write(out)
    return rc


if __name__ == "__main__":
    sys.exit(_main())
