"""Which conntrack entries go (agent/core/flows.py): decided by state, per identity."""
from __future__ import annotations

from agent.core.flows import Flow, Query, queries, stale
from agent.core.model import Backend, Identity

TCP, UDP = 6, 17
A, B = Backend("10.0.1.11", 8080), Backend("10.0.1.12", 8080)


def flow(proto: int, reply: tuple[str, int] | None = None, dport: int = 53) -> Flow:
    """An entry toward 172.18.0.10:dport; NATed to `reply` (None: not NATed)."""
    src, sport = reply or ("172.18.0.10", dport)
    return Flow(proto, "172.18.0.100", 40000, "172.18.0.10", dport, src, sport, 7)


def test_a_flow_knows_its_identity_and_backend() -> None:
    assert flow(UDP, A).identity == Identity("172.18.0.10", 53, "udp")
    assert flow(UDP, A).backend == A
    assert flow(UDP).backend is None  # answered by the address it was sent to: not NATed
    assert Flow(1, "a", 0, "b", 0, "b", 0).identity is None  # not a protocol identities have


def test_every_flow_of_an_identity_that_went_is_stale() -> None:
    assert stale(flow(TCP, A), None) and stale(flow(UDP, A), None) and stale(flow(UDP), None)


def test_a_udp_flow_is_stale_unless_natted_to_a_current_backend() -> None:
    assert not stale(flow(UDP, A), (A, B))
    assert stale(flow(UDP, A), (B,))  # its backend left
    assert stale(flow(UDP), (A, B))  # began before the identity existed: never NATed


def test_a_tcp_flow_of_a_served_identity_is_never_stale() -> None:
    assert not stale(flow(TCP, A), (B,))  # finishes on its backend
    assert not stale(flow(TCP), (A,))


def test_queries_filter_per_identity_until_an_address_has_many() -> None:
    udp = [Identity("172.18.0.10", p, "udp") for p in (53, 54)]
    tcp = Identity("172.18.0.10", 80, "tcp")
    assert queries(udp + [tcp]) == [Query("172.18.0.10", UDP, 53), Query("172.18.0.10", UDP, 54)]
    assert queries([tcp]) == []  # a surviving TCP identity's flows are never stale: no dump
    assert queries([], gone=[tcp]) == [Query("172.18.0.10", TCP, 80)]
    many = [Identity("172.18.0.11", p, "udp") for p in range(1000, 1005)]
    assert queries(many, per_port=4) == [Query("172.18.0.11", UDP)]  # one dump for the address
