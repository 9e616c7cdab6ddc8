from agent.core.model import Backend, Identity
from tests.oracles import build_inventory, desired_services
from tests.builders import eip, rule


def services(objects, max_backends=256):
    return desired_services(build_inventory(objects, "gw1").rules, max_backends)


def test_rules_group_by_identity_with_deduplicated_sorted_backends():
    d = services([eip("eip-web", "172.18.0.10"),
                  rule("b", 80, "10.0.1.12"), rule("a", 80, "10.0.1.11"), rule("dup", 80, "10.0.1.11"),
                  rule("u", 80, "10.0.1.11", proto="udp")])
    tcp = d.services[Identity("172.18.0.10", 80, "tcp")]
    assert tcp.backends == (Backend("10.0.1.11", 8080), Backend("10.0.1.12", 8080))
    assert tcp.rule_names == ("a", "b", "dup")
    assert set(d.services) == {Identity("172.18.0.10", 80, "tcp"), Identity("172.18.0.10", 80, "udp")}


def test_protocol_case_does_not_split_an_identity():
    # The legacy script hashed the protocol as given: TCP and tcp became two chains.
    d = services([eip("eip-web", "172.18.0.10"), rule("a", 80, "10.0.1.11", proto="TCP"), rule("b", 80, "10.0.1.12")])
    assert list(d.services) == [Identity("172.18.0.10", 80, "tcp")]
    assert len(d.services[Identity("172.18.0.10", 80, "tcp")].backends) == 2


def test_same_port_on_two_eips_is_two_identities():
    d = services([eip("eip-web", "172.18.0.10"), eip("eip-2", "172.18.0.20"),
                  rule("a", 80, "10.0.1.11"), rule("b", 80, "10.0.1.12", eip_name="eip-2")])
    assert set(d.services) == {Identity("172.18.0.10", 80, "tcp"), Identity("172.18.0.20", 80, "tcp")}


def test_affinity_disagreement_is_clientip_with_longest_timeout_and_noted():
    objs = [eip("eip-web", "172.18.0.10"), rule("a", 80, "10.0.1.11"),
            rule("b", 80, "10.0.1.12", affinity="ClientIP", timeout=60),
            rule("c", 80, "10.0.1.13", affinity="ClientIP", timeout=900)]
    for order in (objs, list(reversed(objs))):
        d = services(order)
        s = d.services[Identity("172.18.0.10", 80, "tcp")]
        assert (s.affinity, s.timeout) == (True, 900)
        assert len(d.notes) == 1 and "disagree" in d.notes[0]


def test_agreeing_siblings_produce_no_note():
    d = services([eip("eip-web", "172.18.0.10"), rule("a", 80, "10.0.1.11", affinity="ClientIP", timeout=60),
                  rule("b", 80, "10.0.1.12", affinity="ClientIP", timeout=60)])
    assert d.notes == ()
    assert d.services[Identity("172.18.0.10", 80, "tcp")].timeout == 60


def test_identity_over_backend_limit_is_refused_whole_others_kept():
    objs = [eip("eip-web", "172.18.0.10"), rule("ok", 53, "10.0.1.11", proto="udp")]
    objs += [rule(f"r{i}", 80, f"10.0.2.{i}") for i in range(1, 6)]
    d = services(objs, max_backends=4)
    assert list(d.services) == [Identity("172.18.0.10", 53, "udp")]
    assert sorted(e.name for e in d.errors) == [f"r{i}" for i in range(1, 6)]
    assert all("limit 4" in e.reason for e in d.errors)


def test_a_rule_name_defined_twice_is_refused_others_kept():
    inv = build_inventory([eip("eip-web", "172.18.0.10"), rule("twice", 80, "10.0.1.11"),
                           rule("twice", 80, "10.0.1.12"), rule("once", 80, "10.0.1.13")], "gw1")
    assert [r.name for r in inv.rules] == ["once"]
    assert [(e.name, e.field) for e in inv.errors] == [("twice", "metadata.name")]
    assert "2 times" in inv.errors[0].reason


def test_an_eip_defined_twice_refuses_its_rules():
    inv = build_inventory([eip("eip-web", "172.18.0.10"), eip("eip-web", "172.18.0.20"),
                           rule("a", 80, "10.0.1.11")], "gw1")
    assert inv.rules == ()
    assert [(e.name, e.field) for e in inv.errors] == [("a", "spec.eip")]
    assert "defined more than once" in inv.errors[0].reason


def test_identity_limit_refuses_newcomers_until_room_frees_up():
    from agent.core.desired import DesiredState
    from tests.sources import Store

    store = Store()
    store.put(eip("eip-web", "172.18.0.10"))
    for port in (80, 81):
        store.put(rule(f"r{port}", port, "10.0.1.11"))
    state = DesiredState("gw1", max_backends=256, max_identities=2)
    state.rebuild(store)
    store.take()
    store.put(rule("r82", 82, "10.0.1.11"))
    state.update(store, store.take())
    assert sorted(i.port for i in state.services) == [80, 81]
    (err,) = state.errors
    assert (err.name, err.field) == ("r82", "spec.eip") and "maximum of 2 identities" in err.reason
    store.drop("IptablesDnatRule", "r80")
    dirty = state.update(store, store.take())
    assert sorted(i.port for i in state.services) == [81, 82]  # the waiting one got the room
    assert Identity("172.18.0.10", 82, "tcp") in dirty and state.errors == []
