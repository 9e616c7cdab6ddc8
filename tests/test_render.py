"""Rendering: the golden table for examples/, slots that stay put, comments, the
consistent choice's buckets."""
import json

from agent.sources.directory import DirectorySource
from agent.core.consistent import SIZE, table
from agent.core.layout import CHASH, goto_target, identity_key, parse_target, slots_of, sticky_slot
from agent.core.model import Backend, Identity
from agent.core.plan import document, plan
from agent.core.render import assign_slots, render_all
from agent.core.ruleset import EMPTY, Elem
from tests.builders import ROOT, rendered, rule, web_objects
from tests.oracles import build_inventory, desired_services
from tests.golden import check_golden


def test_examples_render_matches_golden():
    source = DirectorySource(ROOT / "examples")
    source.poll()
    check_golden(ROOT / "rulesets" / "examples.json", document(plan(None, rendered(source.objects()), "ip", "natgw").commands))


def test_surviving_backends_keep_their_slots(web_objects):
    before = rendered(web_objects)
    web = Identity("172.18.0.10", 80, "tcp")
    assert slots_of(before)[web] == {Backend("10.0.1.11", 8080): 0, Backend("10.0.1.12", 8080): 1,
                                     Backend("10.0.1.13", 8080): 2}
    without_b = rendered([o for o in web_objects if o["metadata"]["name"] != "web-b"], before)
    assert slots_of(without_b)[web] == {Backend("10.0.1.11", 8080): 0, Backend("10.0.1.13", 8080): 2}
    assert parse_target(without_b.elements["services"][("172.18.0.10", "tcp", 80)].value["goto"]["target"]) == (False, 0)
    refilled = rendered([o for o in web_objects if o["metadata"]["name"] != "web-b"]
                        + [rule("web-e", 80, "10.0.1.15")], without_b)
    assert slots_of(refilled)[web][Backend("10.0.1.15", 8080)] == 1  # lowest free slot


def test_assign_slots_is_lowest_free_and_stable():
    web = Identity("1.1.1.1", 80, "tcp")
    a, b, c = Backend("10.0.0.1", 1), Backend("10.0.0.2", 1), Backend("10.0.0.3", 1)

    class Svc:
        backends = (a, c)
        affinity = False

    assert assign_slots({web: Svc}, {web: {a: 3, b: 0}}) == {web: {a: 3, c: 0}}


def test_a_clientip_newcomer_never_takes_a_slot_whose_old_pins_remain():
    """The slot a departing backend held keeps its clients' affinity entries until the
    cleanup deletes them: given to a newcomer in the same change, or while blocked,
    those clients would follow the newcomer (and the delete would take its fresh pins)."""
    web = Identity("1.1.1.1", 80, "tcp")
    a, b, c, d = (Backend(f"10.0.0.{n}", 1) for n in (1, 2, 3, 4))

    class Sticky:
        backends = (a, c)
        affinity = True

    # b left slot 0 in this very change: c takes the lowest slot that no one held.
    assert assign_slots({web: Sticky}, {web: {a: 1, b: 0}}) == {web: {a: 1, c: 2}}
    # Slot 0 freed earlier, its old pins not yet deleted: blocked for this identity only.
    assert assign_slots({web: Sticky}, {web: {a: 1}}, {web: {0}}) == {web: {a: 1, c: 2}}
    other = Identity("1.1.1.1", 81, "tcp")
    assert assign_slots({other: Sticky}, {other: {a: 1}}, {web: {0}}) == {other: {a: 1, c: 0}}
    # Once unblocked the slot is free again.
    assert assign_slots({web: Sticky}, {web: {a: 1}}) == {web: {a: 1, c: 0}}
    # A new identity with a blocked slot (it went and came back before the cleanup ran).
    Sticky.backends = (a, c, d)
    assert assign_slots({web: Sticky}, {}, {web: {1}}) == {web: {a: 0, c: 2, d: 3}}


def test_rule_names_reach_comments_truncated(web_objects):
    many = web_objects + [rule(f"web-extra-{i:03d}-with-a-long-name", 80, "10.0.1.11") for i in range(20)]
    rs = rendered(many)
    comment = rs.elements["services"][("172.18.0.10", "tcp", 80)].comment
    assert len(comment) <= 128 and comment.endswith("more")
    assert rs.elements["backend_1"][("172.18.0.10", "tcp", 80)].comment is None  # names only on services: see docs/dataplane.md


def test_the_hairpin_snat_marks_vpc_side_packets_of_served_identities_only():
    from tests.oracles import build_inventory, desired_services
    from agent.core.plan import plan
    from agent.core.render import Snat
    from tests.oracles import render
    from agent.core.ruleset import EMPTY
    from tests.fakenft import FakeNft

    services = desired_services(build_inventory(web_objects(), "gw1").rules, 256).services
    plain = render(services, EMPTY, 1024, -160)
    assert "postrouting" not in plain.chains  # off by default: the layout as before
    hairpin = render(services, EMPTY, 1024, -160, Snat("eth0", hairpin=0x4000))
    assert hairpin.chains["postrouting"] == {"type": "nat", "hook": "postrouting", "prio": 99, "policy": "accept"}
    assert set(hairpin.chains) - set(plain.chains) == {"postrouting"}
    fake = FakeNft("1.1.3")
    fake.json_cmd({"nftables": list(plan(None, hairpin, "ip", "natgw", text_maps=False).commands)})
    inside, outside, elsewhere = {}, {}, {}
    assert fake.trace("10.0.1.50", "172.18.0.10", "tcp", 80, iif="eth0", packet=inside) == ("10.0.1.11", 8080)
    assert inside["mark"] == 0x4000  # a VPC client of an identity: SNATed on the way out
    assert fake.trace("172.18.0.100", "172.18.0.10", "tcp", 80, packet=outside) == ("10.0.1.11", 8080)
    assert outside["mark"] == 0  # an outside client keeps its address
    assert fake.trace("10.0.1.50", "172.18.0.10", "tcp", 8000, iif="eth0", packet=elsewhere) is None
    assert elsewhere["mark"] == 0  # not an identity of the agent's: not its to SNAT


def test_masquerade_marks_the_connections_of_served_identities_only_and_leaves_the_packet_mark():
    """--masquerade: the slot chain sets a bit of the connection's mark (never the packet's,
    kube-ovn's), and the postrouting chain masquerades what carries it out of the VPC side."""
    from tests.oracles import build_inventory, desired_services, render
    from agent.core.plan import plan
    from agent.core.render import Snat
    from agent.core.ruleset import EMPTY
    from tests.fakenft import FakeNft

    services = desired_services(build_inventory(web_objects(), "gw1").rules, 256).services
    plain = render(services, EMPTY, 1024, -160)
    masq = render(services, EMPTY, 1024, -160, Snat("eth0", masquerade=0x4000))
    assert set(masq.chains) - set(plain.chains) == {"postrouting"}
    assert masq.rules["postrouting"] == ({"expr": [
        {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "eth0"}},
        {"match": {"op": "==", "left": {"&": [{"ct": {"key": "mark"}}, 0x4000]}, "right": 0x4000}},
        {"masquerade": {"flags": ["fully-random"]}}]},)
    assert masq.sets == plain.sets and masq.elements == plain.elements  # no element per identity: a commit costs the same
    fake = FakeNft("1.1.3")
    fake.json_cmd({"nftables": list(plan(None, masq, "ip", "natgw", text_maps=False).commands)})
    for client, iif in (("172.18.0.100", "net1"), ("10.0.1.50", "eth0")):  # outside, and a hairpin client
        packet: dict = {}
        assert fake.trace(client, "172.18.0.10", "tcp", 80, iif=iif, packet=packet) == ("10.0.1.11", 8080)
        assert packet["ct mark"] == 0x4000 and packet["mark"] == 0, packet
    elsewhere: dict = {}
    assert fake.trace("172.18.0.100", "172.18.0.10", "tcp", 8000, packet=elsewhere) is None
    assert elsewhere["ct mark"] == 0  # not the agent's identity: not its to SNAT
    both = render(services, EMPTY, 1024, -160, Snat("eth0", hairpin=0x1000, masquerade=0x4000))
    assert [r["expr"][-1] for r in both.rules["postrouting"]] == [
        {"snat": {"family": "ip", "addr": {"ct": {"key": "ip daddr", "dir": "original"}}, "flags": ["fully-random"]}},
        {"masquerade": {"flags": ["fully-random"]}}]  # the hairpin's SNAT to the EIP first: one binds, per flow


def _led_to(rs, identity):
    """Bucket -> backend as a rendered table leads a client with no pin: the bucket's sticky
    chain names a slot, the slot's backend map holds the backend."""
    by_slot = {slot: backend for backend, slot in slots_of(rs)[identity].items()}
    return [by_slot[sticky_slot(goto_target(Elem(v)))] for v in rs.elements[CHASH][identity_key(identity)]]


def test_every_replica_renders_the_same_choice_whatever_its_slots(web_objects):
    """Two replicas, one whose backends came in another order and hold other slots: their
    chash elements differ (other sticky chains) but lead each bucket to the same backend,
    consistent.table's."""
    app = Identity("172.18.0.10", 443, "tcp")
    one = rendered(web_objects)
    history = [o for o in web_objects if o["metadata"]["name"] != "app-a"]
    newcomer = rule("app-z", 443, "10.0.1.19", 9090, affinity="ClientIP", timeout=600)
    other = rendered(web_objects, rendered(history, rendered([*history, newcomer])))
    assert slots_of(one)[app] != slots_of(other)[app]  # the histories differ
    assert one.elements[CHASH][identity_key(app)] != other.elements[CHASH][identity_key(app)]
    backends = sorted(slots_of(one)[app])
    assert _led_to(one, app) == _led_to(other, app) == list(table(backends))
    assert len(set(_led_to(one, app))) == len(backends)  # every backend has buckets


def test_without_the_consistent_choice_clientip_picks_at_random_and_has_no_buckets(web_objects):
    services = desired_services(build_inventory(web_objects, "gw1").rules, 64).services
    plain, _ = render_all(services, EMPTY, 1024, -160, consistent=False)
    assert CHASH not in plain.elements and not any(n.startswith(("chash_", "bucket_", "consistent")) for n in
                                                    (*plain.sets, *plain.chains))
    (chain,) = [n for n in plain.chains if n.startswith("aff_")]
    assert "consistent" not in json.dumps(plain.rules[chain]) and "numgen" in json.dumps(plain.rules[chain][-1])
    full, _ = render_all(services, EMPTY, 1024, -160)
    assert full.rules[chain][-2] == {"expr": [{"jump": {"target": "consistent"}}]}
    assert "jhash" in json.dumps(full.rules["consistent"]) and "numgen" in json.dumps(full.rules[chain][-1])
    assert len([n for n in full.sets if n.startswith("chash_")]) == SIZE
