"""The capabilities a sync would use (agent/kernel/caps.py), for a command that must not touch the
gateway's table: `diff`. The running agent's own, from its status socket (what its syncs
use); else the probe run in a private, empty network namespace (`unshare --net`, root:
the same libnftables and kernel, nothing of the caller's namespace touched). In place, the
probe would create the agent's table and commit twice in it, which a running agent
would take for someone else's drift."""
from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from agent.kernel.caps import Capabilities
from agent.kernel.privatens import run_private

FIELDS = {f.name for f in dataclasses.fields(Capabilities)}


def from_status(status: dict[str, Any] | None) -> Capabilities | None:
    """The capabilities a running agent reported (agent/ops/health.py's status), if any."""
    found = (status or {}).get("capabilities")
    if not isinstance(found, dict):
        return None
    return Capabilities(**{k: v for k, v in found.items() if k in FIELDS})


def probe_private(table: str) -> Capabilities:
    """Probe in a namespace of its own; raises RuntimeError when that cannot be made (not
    root, e.g. in a gateway pod's agent container, which has CAP_NET_ADMIN only)."""
    try:
        out = run_private("agent.kernel.privateprobe", table)
    except RuntimeError as err:
        raise RuntimeError(str(err).splitlines()[-1]) from err  # the error, not the traceback before it
    return Capabilities(**json.loads(out))


def _main() -> int:
    from agent.kernel.caps import probe
    from agent.kernel.view import KernelView
    from agent.kernel.nft import Nft

    table = sys.argv[1]
    print(json.dumps(probe(Nft("ip", table), KernelView("ip", table, subscribe=False), "ip", table).as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
