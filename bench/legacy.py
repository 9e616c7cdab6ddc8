"""The legacy script's way (kube-ovn's nat-gateway.sh nft-dnat-map-add): one `nft -f -` process per identity,
each with the commands `nat-gateway.sh nft-dnat-map-add` issues for it, in text syntax.

Written from the description, not copied: table, base chain and map are declared
idempotently; the base chain is flushed and its vmap rule re-added on every add; the
identity gets a chain `dnat-<h>` (emptied and refilled), and its `service-ips` element.
ClientIP adds, per backend b, a timeout set `aff-<h>-<b>` and a chain `ep-<h>-<b>`."""
from __future__ import annotations

from bench.identities import TIMEOUT, Identity, backend_hash

TABLE = "kube-ovn"
MAP = "service-ips"

_HEADER = (
    f"add table ip {TABLE}\n"
    f"add chain ip {TABLE} prerouting {{ type nat hook prerouting priority -150; policy accept; }}\n"
    f"add map ip {TABLE} {MAP} {{ type ipv4_addr . inet_proto . inet_service : verdict; }}\n"
)
_DISPATCH = f"add rule ip {TABLE} prerouting ip daddr . meta l4proto . th dport vmap @{MAP}\n"


def _element(x: Identity) -> str:
    return f"add element ip {TABLE} {MAP} {{ {x.eip} . {x.proto} . {x.port} : goto dnat-{x.h} }}\n"


def _identity_body(x: Identity) -> str:
    """The identity's chains (and sets), emptied and refilled, without the element."""
    h = x.h
    out = [f"add chain ip {TABLE} dnat-{h}\n", f"flush chain ip {TABLE} dnat-{h}\n"]
    n = len(x.backends)
    if not x.affinity:
        pairs = ", ".join(f"{i} : {ip} . {port}" for i, (ip, port) in enumerate(x.backends))
        out.append(f"add rule ip {TABLE} dnat-{h} meta l4proto {x.proto} dnat ip addr . port to numgen random mod {n} map {{ {pairs} }}\n")
        return "".join(out)
    eps = []
    for ip, port in x.backends:
        b = backend_hash(ip, port)
        aff, ep = f"aff-{h}-{b}", f"ep-{h}-{b}"
        eps.append((aff, ep))
        out.append(f"add set ip {TABLE} {aff} {{ type ipv4_addr; flags dynamic,timeout; timeout {TIMEOUT}s; }}\n")
        out.append(f"add chain ip {TABLE} {ep}\n")
        out.append(f"flush chain ip {TABLE} {ep}\n")
        out.append(f"add rule ip {TABLE} {ep} update @{aff} {{ ip saddr }}\n")
        out.append(f"add rule ip {TABLE} {ep} meta l4proto {x.proto} dnat to {ip}:{port}\n")
    for aff, ep in eps:
        out.append(f"add rule ip {TABLE} dnat-{h} ip saddr @{aff} goto {ep}\n")
    vmap = ", ".join(f"{i} : goto {ep}" for i, (_, ep) in enumerate(eps))
    out.append(f"add rule ip {TABLE} dnat-{h} numgen random mod {n} vmap {{ {vmap} }}\n")
    return "".join(out)


def add_identity(x: Identity) -> str:
    """One `nft-dnat-map-add`: what one `nft -f -` process receives."""
    return _HEADER + f"flush chain ip {TABLE} prerouting\n" + _DISPATCH + _identity_body(x) + _element(x)


def state(idents: list[Identity]) -> str:
    """The table the script leaves after adding all of these, in one batch (used only to
    set up the "one change with N present" case; not a measurement of the script)."""
    return _HEADER + _DISPATCH + "".join(_identity_body(x) + _element(x) for x in idents)


def expected_objects(n: int, affinity: bool, backends: int) -> dict[str, int]:
    """What the table must hold after n identities: elements, chains, named sets."""
    return {
        "elements": n,
        "chains": 1 + n + (n * backends if affinity else 0),
        "sets": 1 + (n * backends if affinity else 0),
        # dispatch; per identity its dnat rule, or per backend a check, an update and a dnat plus the vmap
        "rules": 1 + (n * (3 * backends + 1) if affinity else n),
    }
