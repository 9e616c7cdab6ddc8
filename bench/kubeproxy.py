"""kube-proxy's nftables way (pkg/proxy/nftables: a private table, one vmap dispatch, partial syncs), as one `nft -f` batch from one process.

Per identity (kube-proxy: per service port) a chain `service-<h>` whose rule is an inline
`numgen random mod N vmap { i : goto endpoint-<h>-<b> }` (an anonymous map each), and per
backend a chain `endpoint-<h>-<b>` with the dnat; dispatch through one `service-ips`
vmap. ClientIP: per endpoint a timeout set `affinity-<h>-<b>`; the service chain checks
`ip saddr @affinity-...` per endpoint before the numgen, the endpoint chain does
`update @affinity-... { ip saddr }` before its dnat. A change flushes and refills the
changed service's chain in one batch; stale endpoint chains and sets are flushed then and
deleted by a later batch, as kube-proxy does."""
from __future__ import annotations

from bench.identities import TIMEOUT, Identity, backend_hash

TABLE = "kube-proxy"
MAP = "service-ips"


def _header() -> str:
    return (
        f"add table ip {TABLE}\n"
        f"add chain ip {TABLE} nat-prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}\n"
        f"add map ip {TABLE} {MAP} {{ type ipv4_addr . inet_proto . inet_service : verdict; }}\n"
        f"add rule ip {TABLE} nat-prerouting ip daddr . meta l4proto . th dport vmap @{MAP}\n"
    )


def _names(x: Identity, ip: str, port: int) -> tuple[str, str]:
    b = backend_hash(ip, port)
    return f"endpoint-{x.h}-{b}", f"affinity-{x.h}-{b}"


def endpoint_chain(x: Identity, ip: str, port: int) -> str:
    return _names(x, ip, port)[0]


def _endpoint(x: Identity, ip: str, port: int) -> str:
    ep, aff = _names(x, ip, port)
    out = []
    if x.affinity:
        out.append(f"add set ip {TABLE} {aff} {{ type ipv4_addr; flags dynamic,timeout; timeout {TIMEOUT}s; }}\n")
    out.append(f"add chain ip {TABLE} {ep}\n")
    if x.affinity:
        out.append(f"add rule ip {TABLE} {ep} update @{aff} {{ ip saddr }}\n")
    out.append(f"add rule ip {TABLE} {ep} meta l4proto {x.proto} dnat to {ip}:{port}\n")
    return "".join(out)


def _service_rules(x: Identity) -> str:
    svc = f"service-{x.h}"
    names = [_names(x, ip, port) for ip, port in x.backends]
    out = []
    if x.affinity:
        out.extend(f"add rule ip {TABLE} {svc} ip saddr @{aff} goto {ep}\n" for ep, aff in names)
    vmap = ", ".join(f"{i} : goto {ep}" for i, (ep, _) in enumerate(names))
    out.append(f"add rule ip {TABLE} {svc} numgen random mod {len(names)} vmap {{ {vmap} }}\n")
    return "".join(out)


def _identity(x: Identity) -> str:
    return (
        "".join(_endpoint(x, ip, port) for ip, port in x.backends)
        + f"add chain ip {TABLE} service-{x.h}\n"
        + _service_rules(x)
        + f"add element ip {TABLE} {MAP} {{ {x.eip} . {x.proto} . {x.port} : goto service-{x.h} }}\n"
    )


def full(idents: list[Identity]) -> str:
    """A full sync from an empty table: everything in one transaction."""
    return _header() + "".join(_identity(x) for x in idents)


def change(old: Identity, new: Identity) -> tuple[str, str]:
    """(the sync batch, the later cleanup batch) for one identity's backends old -> new."""
    gone = [b for b in old.backends if b not in new.backends]
    added = [b for b in new.backends if b not in old.backends]
    sync = "".join(_endpoint(new, ip, port) for ip, port in added)
    sync += f"flush chain ip {TABLE} service-{new.h}\n" + _service_rules(new)
    sync += "".join(f"flush chain ip {TABLE} {_names(old, ip, port)[0]}\n" for ip, port in gone)
    cleanup = "".join(f"delete chain ip {TABLE} {_names(old, ip, port)[0]}\n" for ip, port in gone)
    if old.affinity:
        cleanup += "".join(f"delete set ip {TABLE} {_names(old, ip, port)[1]}\n" for ip, port in gone)
    return sync, cleanup


def expected_objects(n: int, affinity: bool, backends: int) -> dict[str, int]:
    return {
        "elements": n,
        "chains": 1 + n + n * backends,
        "sets": 1 + (n * backends if affinity else 0),
        # dispatch; per identity the vmap rule (+ a check per endpoint), per endpoint dnat (+ update)
        "rules": 1 + n + n * backends + (2 * n * backends if affinity else 0),
    }
