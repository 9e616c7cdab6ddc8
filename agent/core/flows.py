"""Which conntrack entries toward the agent's identities must go. Pure: no I/O.

NAT chains see only a flow's first packet, so a flow keeps what NAT gave it for as long as
its conntrack entry lives. Compared by state, not by event (kube-proxy moved to this: an
event-based cleanup that is lost is never repeated), after each change and at start:

- every entry toward an identity that is gone: its clients would keep sending into a
  backend that no longer serves it;
- a UDP entry toward an identity that is not NATed to one of the identity's backends now:
  one of a backend that left, or one that began before the identity existed (a one-way
  sender's entry has no NAT and, left alone, is never balanced: kube-ovn #4193);
- never a TCP entry toward an identity that is still served: a TCP flow finishes on the
  backend it began with, and its client's next connection is balanced anew."""
from __future__ import annotations

from typing import Iterable, NamedTuple

from agent.core.model import Backend, Identity

PROTOS = {"tcp": 6, "udp": 17}
PROTO_NAMES = {v: k for k, v in PROTOS.items()}


class Flow(NamedTuple):
    """One conntrack entry, as much of it as the decision and its delete need."""

    proto: int
    src: str  # original direction: the client ...
    sport: int
    dst: str  # ... and what it asked for (an EIP)
    dport: int
    reply_src: str  # who answers: the backend, when NATed
    reply_sport: int
    id: int | None = None  # the kernel's id for the entry: a delete takes only that entry
    zone: int = 0

    @property
    def identity(self) -> Identity | None:
        name = PROTO_NAMES.get(self.proto)
        return Identity(self.dst, self.dport, name) if name else None

    @property
    def backend(self) -> Backend | None:
        """The backend the entry was NATed to (None: not NATed: the answer comes from
        where the client sent it)."""
        if self.reply_src == self.dst and self.reply_sport == self.dport:
            return None
        return Backend(self.reply_src, self.reply_sport)


class Query(NamedTuple):
    """One dump: entries whose original destination is this address and protocol (and,
    given, port)."""

    eip: str
    proto: int
    port: int | None = None


def stale(flow: Flow, backends: Iterable[Backend] | None) -> bool:
    """Whether the entry must go, given the identity's backends now (None: it is gone)."""
    if backends is None:
        return True
    if flow.proto != PROTOS["udp"]:
        return False
    backend = flow.backend
    return backend is None or backend not in backends


def queries(identities: Iterable[Identity], gone: Iterable[Identity] = (), per_port: int = 4) -> list[Query]:
    """The dumps that see every entry toward these identities. Per identity (the kernel
    filters by port too) while an address has at most `per_port` of them to check, else
    one dump per address and protocol. A surviving TCP identity needs none: its entries
    are never stale."""
    wanted: dict[tuple[str, int], set[int]] = {}
    for identity in identities:
        if identity.proto == "udp":
            wanted.setdefault((identity.eip, PROTOS["udp"]), set()).add(identity.port)
    for identity in gone:
        wanted.setdefault((identity.eip, PROTOS[identity.proto]), set()).add(identity.port)
    out: list[Query] = []
    for (eip, proto), ports in sorted(wanted.items()):
        if len(ports) <= per_port:
            out += [Query(eip, proto, port) for port in sorted(ports)]
        else:
            out.append(Query(eip, proto))
    return out
