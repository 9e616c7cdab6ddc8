"""What this libnftables and kernel can do, probed at start, not assumed from a version
number (firewalld's way: ask, and read back what the kernel really did). Every
version-specific path of the agent is decided here.

Measured: nft 1.0.6's JSON parser refuses a map whose data is a concatenation in the form
it lists one ("ipv4_addr . inet_service") and silently makes a plain *set* of the list
form (["ipv4_addr", "inet_service"]); 1.1.3 makes the map. So the probe declares such a
map in the agent's own table and reads the kernel's answer back over netlink."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from agent.errors import ApplyError
from agent.core.commands import Table
from agent.core.layout import BACKEND_DATA, IDENTITY_TYPE
from agent.core.plan import Plan, one_transaction

PROBE_MAP = "natgw_probe"


@dataclass(frozen=True)
class Capabilities:
    nft_version: str = "unknown"
    """nftables' version as `nft --version` reports it (Nft.version(); "unknown" when that
    fails), not a listing's metainfo: the agent lists nothing through libnftables. For the
    record only: what the agent does follows the probes."""

    kernel: str = "unknown"
    """The kernel release (uname -r)."""

    json_concat_maps: bool = False
    """JSON declares a map with concatenated data (nft >= 1.1.0): no nft text step."""

    destroy: bool = False
    """The `destroy` verb (nft >= 1.0.8, kernel >= 6.3): a delete that cannot fail on
    something already gone (an expired affinity entry)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


UNPROBED = Capabilities()


class Writer(Protocol):
    def apply(self, plan: Plan) -> None: ...
    def version(self) -> str: ...
    def accepts(self, commands: list[dict[str, Any]]) -> bool: ...


class Reader(Protocol):
    def declaration(self, name: str) -> dict[str, Any] | None: ...


def probe(nft: Writer, view: Reader, family: str, table: str) -> Capabilities:
    """Probe in the agent's own table (created if missing, as the first sync would):
    declare a concatenated-data map in JSON, read the kernel's declaration back, delete
    it. Two transactions of the agent's own; nothing of the data plane changes."""
    t = Table(family, table)
    concat = False
    try:
        nft.apply(one_transaction([t.add(),
                                   t.add_set(PROBE_MAP, {"type": IDENTITY_TYPE, "map": BACKEND_DATA.split(" . ")})]))
        declared = view.declaration(PROBE_MAP) or {}  # none: a set, as nft 1.0.6 would have made
        concat = declared.get("map") == BACKEND_DATA
        nft.apply(one_transaction([t.delete_set(PROBE_MAP, declared)]))
    except ApplyError:
        pass  # refused outright: JSON cannot declare it
    # Destroying a table that is not there: refused by nft < 1.0.8's parser or by a kernel
    # before 6.3 (a dry run still asks the kernel), accepted where destroy works.
    destroy = nft.accepts([Table(family, f"{table}_absent").destroy()])
    return Capabilities(nft_version=nft.version(), kernel=os.uname().release, json_concat_maps=concat,
                        destroy=destroy)
