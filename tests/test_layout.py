"""The table's layout: names, and reading them back."""
from __future__ import annotations

from typing import Any

from agent.core.layout import (SERVICES, backend_counters, goto_target, held_slots, identity_key,
                          parse_target, pattern_chain, pinned_clients, served, slots_of, sticky_slots)
from agent.core.model import Backend, Identity
from agent.core.ruleset import Ruleset, element, goto
from tests.builders import rendered, rule
from tests.oracles import affinity_sets


def test_pattern_chain_names():
    assert pattern_chain((0, 1, 2), None) == "lb_n3"
    assert pattern_chain((0, 2), 600) == "aff_t600_s0.2"
    long = pattern_chain(tuple(range(1, 200)), None)
    assert long.startswith("lb_h") and len(long) < 64
    for name in ("lb_n3", "aff_t600_s0.2", long):
        assert parse_target(name) is not None
    assert parse_target("prerouting") is None


# --- reading a rendered table back ----------------------------------------------------------
# Rulesets from agent/core/render.py (tests.builders.rendered on web_objects: 80/tcp stateless
# over 3 backends, 443/tcp ClientIP 600 s over 2, 53/udp over 1).

WEB = Identity("172.18.0.10", 80, "tcp")
APP = Identity("172.18.0.10", 443, "tcp")
DNS = Identity("172.18.0.10", 53, "udp")


def b(ip: str, port: int) -> Backend:
    return Backend(ip, port)


def with_holes(web_objects: list[dict[str, Any]]) -> Ruleset:
    """The table after web-a and app-a left (slot 0 freed) and web-d came (and took it)."""
    gone = ("web-a", "app-a")
    kept = [o for o in web_objects if o["metadata"]["name"] not in gone]
    return rendered(kept + [rule("web-d", 80, "10.0.1.14")], rendered(web_objects))


def test_slots_round_trip(web_objects: list[dict[str, Any]]) -> None:
    assert slots_of(rendered(web_objects)) == {
        WEB: {b("10.0.1.11", 8080): 0, b("10.0.1.12", 8080): 1, b("10.0.1.13", 8080): 2},
        APP: {b("10.0.1.11", 9090): 0, b("10.0.1.12", 9090): 1},
        DNS: {b("10.0.1.12", 5353): 0}}
    holes = with_holes(web_objects)
    assert slots_of(holes) == {
        WEB: {b("10.0.1.14", 8080): 0, b("10.0.1.12", 8080): 1, b("10.0.1.13", 8080): 2},
        APP: {b("10.0.1.12", 9090): 1},  # kept its slot: its pinned clients stay in aff_1
        DNS: {b("10.0.1.12", 5353): 0}}


def test_held_slots_of_one_identity_are_its_share_of_the_table(web_objects: list[dict[str, Any]]) -> None:
    holes = with_holes(web_objects)
    for identity, slots in slots_of(holes).items():
        key = identity_key(identity)
        mine = {name: elems[key] for name, elems in holes.elements.items() if key in elems}
        assert SERVICES in mine  # ignored: not a backend map
        assert held_slots(mine) == slots


def test_sticky_slots_only_for_clientip_identities(web_objects: list[dict[str, Any]]) -> None:
    assert sticky_slots(rendered(web_objects)) == {APP: {0: b("10.0.1.11", 9090), 1: b("10.0.1.12", 9090)}}
    assert sticky_slots(with_holes(web_objects)) == {APP: {1: b("10.0.1.12", 9090)}}
    assert affinity_sets(rendered(web_objects)) == ["aff_0", "aff_1"]


def test_served_identities_and_their_targets(web_objects: list[dict[str, Any]]) -> None:
    rs = rendered(web_objects)
    targets = {identity: parse_target(goto_target(elem)) for identity, elem in served(rs)}
    assert list(targets) == [DNS, WEB, APP]  # identity order
    assert targets == {DNS: (False, 0), WEB: (False, 0), APP: (True, 600)}
    # Of all the chains rendered, only the services' targets read as patterns.
    assert {c for c in rs.chains if parse_target(c)} == {goto_target(e) for _, e in served(rs)}
    assert goto_target(element(b("10.0.1.11", 8080))) == ""  # a backend element goes nowhere


def test_backend_counters_are_keyed_by_identity_and_backend_as_text(web_objects: list[dict[str, Any]]) -> None:
    rs = rendered(web_objects)
    web, dns = identity_key(WEB), identity_key(DNS)
    counters = {"backend_0": {web: (3, 180), dns: (1, 60)}, "backend_2": {web: (5, 300)},
                SERVICES: {web: (9, 9)},  # not a backend map
                "backend_1": {("172.18.0.10", "tcp", 9999): (7, 7)}}  # no element: not ours to name
    assert backend_counters(rs.elements, counters) == {
        ("172.18.0.10:80/tcp", "10.0.1.11:8080"): (3, 180),
        ("172.18.0.10:53/udp", "10.0.1.12:5353"): (1, 60),
        ("172.18.0.10:80/tcp", "10.0.1.13:8080"): (5, 300)}


def test_pinned_clients_counted_per_identity_and_slot() -> None:
    app, web = identity_key(APP), identity_key(WEB)
    entries = {"aff_0": [("192.0.2.1", *app), ("192.0.2.2", *app), ("192.0.2.1", *web)],
               "aff_1": [("192.0.2.3", *app), app],  # a key that is not client . identity: not a pin
               "backend_0": [("192.0.2.9", *app)]}  # not an affinity set
    assert pinned_clients(entries) == {(APP, 0): 2, (WEB, 0): 1, (APP, 1): 1}


def test_what_someone_else_altered_is_not_read_as_a_slot(web_objects: list[dict[str, Any]]) -> None:
    rs = rendered(web_objects)
    rs.elements["backend_2"][identity_key(WEB)] = element(goto("slot_2"))  # a verdict where a backend was
    assert slots_of(rs)[WEB] == {b("10.0.1.11", 8080): 0, b("10.0.1.12", 8080): 1}
    assert ("172.18.0.10:80/tcp", "10.0.1.13:8080") not in backend_counters(rs.elements, {"backend_2": {
        identity_key(WEB): (1, 1)}})


def test_slots_of_the_earlier_layout_are_read_for_the_upgrade() -> None:
    key = identity_key(WEB)
    earlier = Ruleset(elements={"addr_3": {key: element("10.0.1.11")}, "port_3": {key: element(8080)},
                                "addr_x": {key: element("10.0.1.99")}, "port_x": {key: element(99)}})  # no slot
    assert slots_of(earlier) == {WEB: {b("10.0.1.11", 8080): 3}}
