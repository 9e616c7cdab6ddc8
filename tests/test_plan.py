"""Planning: what a change costs, in which order, and in which phases."""
import json

import pytest

from agent.core.commands import CommandError
from tests.oracles import build_inventory, desired_services
from agent.core.layout import sticky_slots
from agent.core.model import Backend, Identity
from agent.core.consistent import SIZE
from agent.core.plan import DECLARE, MAIN, PREPARE, document, plan, retire, stale_chains
from tests.oracles import render
from agent.core.ruleset import Ruleset
from agent.settings import Settings
from tests.builders import ROOT, rendered, rule
from tests.fakenft import FakeNft, edges
from tests.golden import check_golden

S = Settings()


def test_hole_after_backend_removal_matches_golden(web_objects):
    before = rendered(web_objects)
    after = rendered([o for o in web_objects if o["metadata"]["name"] != "web-b"], before)
    check_golden(ROOT / "rulesets" / "backend-removed.plan.json", document(plan(before, after, "ip", "natgw").commands))


def test_no_change_plans_nothing(web_objects):
    first = rendered(web_objects)
    assert plan(first, rendered(web_objects, first), "ip", "natgw").commands == ()


def test_fresh_table_plan_creates_table_then_everything(web_objects):
    cmds = plan(None, rendered(web_objects), "ip", "natgw").commands
    assert cmds[0] == {"add": {"table": {"family": "ip", "name": "natgw"}}}
    assert not any("delete" in c or "flush" in c for c in cmds)


def test_one_backend_change_touches_only_its_identity(web_objects):
    before = rendered(web_objects)
    changed = [o for o in web_objects if o["metadata"]["name"] != "web-c"] + [rule("web-d", 80, "10.0.1.14")]
    cmds = plan(before, rendered(changed, before), "ip", "natgw").commands
    # Only element operations, all on 172.18.0.10:80/tcp; no chain or set is touched.
    assert cmds and all(set(c[next(iter(c))]) == {"element"} for c in cmds)
    keys = {json.dumps(e) for c in cmds for e in c[next(iter(c))]["element"]["elem"]}
    assert all('"172.18.0.10", "tcp", 80]' in k for k in keys), keys
    assert len(cmds) == 4  # delete addr/port of the old backend; add addr/port of the new one in its slot


def test_clientip_change_of_other_backend_keeps_affinity_set_and_chain(web_objects):
    before = rendered(web_objects)
    after = rendered(web_objects + [rule("app-c", 443, "10.0.1.13", 9090, affinity="ClientIP", timeout=600)], before)
    cmds = plan(before, after, "ip", "natgw").commands
    # Slots 0 and 1 keep their sets: nothing deletes or flushes them or their sticky chains.
    for c in cmds:
        verb, body = next(iter(c.items()))
        obj = next(iter(body.values()))
        if verb in ("delete", "flush"):
            assert obj.get("name") not in ("aff_0", "aff_1", "sticky_0_t600", "sticky_1_t600"), c
    assert sticky_slots(after)[Identity("172.18.0.10", 443, "tcp")] == {
        0: Backend("10.0.1.11", 9090), 1: Backend("10.0.1.12", 9090), 2: Backend("10.0.1.13", 9090)}


def test_deleting_last_identity_empties_shared_chains_and_retires_them_later(web_objects):
    before = rendered(web_objects)
    after = rendered([web_objects[0]], before)
    cmds = plan(before, after, "ip", "natgw").commands
    deleted = {next(iter(c["delete"].values()))["name"] for c in cmds if "delete" in c and "element" not in c["delete"]}
    flushed = {c["flush"]["chain"]["name"] for c in cmds if "flush" in c}
    buckets = range(SIZE)
    assert deleted == {"backend_0", "backend_1", "backend_2", "aff_0", "aff_1", *(f"chash_{b}" for b in buckets)}
    chains = {"slot_0", "slot_1", "slot_2", "lb_n3", "lb_n1", "aff_t600_n2", "sticky_0_t600", "sticky_1_t600",
              "consistent", *(f"bucket_{b}" for b in buckets)}
    assert flushed == chains  # emptied in this transaction ...
    assert set(stale_chains(before, after)) == chains
    assert {c["delete"]["chain"]["name"] for c in retire(sorted(chains), "ip", "natgw").commands} == chains  # ... deleted later
    assert after.elements["services"] == {}
    assert plan(after, rendered([web_objects[0]], after), "ip", "natgw").commands == ()


def test_an_object_of_any_name_read_back_is_removed_but_only_nft_names_are_created(web_objects):
    """What the agent deletes may carry any name the kernel holds (someone else added it to
    the agent's table); what it creates must be a name nft's grammar takes (commands.py)."""
    desired = rendered(web_objects)
    foreign = Ruleset({**desired.sets, "a set": {"type": ["ipv4_addr"]}}, {**desired.chains, "a chain": {}},
                      {**desired.rules, "a chain": ({"expr": [{"accept": None}]},)}, desired.elements)
    cmds = plan(foreign, desired, "ip", "natgw").commands
    assert cmds == (
        {"flush": {"chain": {"family": "ip", "table": "natgw", "name": "a chain"}}},
        {"delete": {"set": {"family": "ip", "table": "natgw", "name": "a set"}}})
    assert retire(stale_chains(foreign, desired), "ip", "natgw").commands == (
        {"delete": {"chain": {"family": "ip", "table": "natgw", "name": "a chain"}}},)
    with pytest.raises(CommandError, match="cannot add set 'a set': not an nft name"):
        plan(desired, foreign, "ip", "natgw")


def test_declaration_change_redeclares_in_the_same_transaction(web_objects):
    """A new affinity set size or base chain priority: rules flushed, the changed objects
    deleted and declared anew, everything else (elements, backend maps) kept."""
    before = rendered(web_objects)
    services = desired_services(build_inventory(web_objects, "gw1").rules, 256).services
    after = render(services, before, 1024, S.priority + 1)
    cmds = plan(before, after, "ip", "natgw").commands
    ref = {"family": "ip", "table": "natgw"}
    assert list(cmds[:4]) == [{"flush": {"table": {"family": "ip", "name": "natgw"}}},
                        {"delete": {"set": {**ref, "name": "aff_0"}}}, {"delete": {"set": {**ref, "name": "aff_1"}}},
                        {"delete": {"chain": {**ref, "name": "prerouting"}}}]
    assert not any("table" in c.get("delete", {}) or "element" in c.get("delete", {}) for c in cmds)
    added = {(k, b.get("name") or b.get("chain")) for c in cmds if "add" in c for k, b in c["add"].items()}
    assert {("set", "aff_0"), ("set", "aff_1"), ("chain", "prerouting")} <= added
    assert not any(k == "map" or k == "element" for k, _ in added)  # maps and their elements stay
    assert len([c for c in cmds if "rule" in c.get("add", {})]) == sum(len(r) for r in after.rules.values())
    assert plan(after, after, "ip", "natgw").commands == ()


def test_an_altered_backend_map_is_emptied_of_its_users_and_redeclared(web_objects):
    """A backend map declared otherwise than wanted (only nft text can declare it): the
    chain using it is emptied and the map deleted in a first phase, then it is declared in
    text and the rest follows; nothing else (other slots, affinity sets, the table) is
    touched."""
    before = rendered(web_objects)
    tampered = Ruleset({**before.sets, "backend_0": {**before.sets["backend_0"], "stmt": []}},
                       before.chains, before.rules, before.elements)
    todo = plan(tampered, before, "ip", "natgw")
    cmds = todo.commands
    ref = {"family": "ip", "table": "natgw"}
    assert cmds[:2] == ({"flush": {"chain": {**ref, "name": "slot_0"}}}, {"delete": {"map": {**ref, "name": "backend_0"}}})
    touched = {(verb, kind, body.get("name") or body.get("chain")) for c in cmds for verb, o in c.items() for kind, body in o.items()}
    assert touched == {("flush", "chain", "slot_0"), ("delete", "map", "backend_0"), ("add", "map", "backend_0"),
                       ("add", "rule", "slot_0"), ("add", "element", "backend_0")}
    assert [p.kind for p in todo.phases] == [PREPARE, DECLARE, MAIN]
    prepare, declare, main = todo.phases
    assert prepare.commands == cmds[:2]
    assert declare.commands == ({"add": {"table": {"family": "ip", "name": "natgw"}}},
                                *(c for c in cmds if "map" in c.get("add", {})))
    assert main.commands == tuple(c for c in cmds[2:] if "map" not in c.get("add", {}))


def test_a_backend_map_someone_made_a_plain_set_is_deleted_as_the_set_it_is(web_objects):
    """nft 1.0.6 makes a plain set of a map declared in list form (agent/kernel/caps.py): a
    delete names the kind the kernel holds (commands.set_kind; 1.0.6 takes either kind)."""
    before = rendered(web_objects)
    made_a_set = {k: v for k, v in before.sets["backend_0"].items() if k != "map"}
    tampered = Ruleset({**before.sets, "backend_0": made_a_set}, before.chains, before.rules,
                       {n: e for n, e in before.elements.items() if n != "backend_0"})
    cmds = plan(tampered, before, "ip", "natgw").commands
    ref = {"family": "ip", "table": "natgw"}
    assert cmds[:2] == ({"flush": {"chain": {**ref, "name": "slot_0"}}}, {"delete": {"set": {**ref, "name": "backend_0"}}})
    assert {"add": {"map": {**ref, "name": "backend_0", **before.sets["backend_0"]}}} in cmds


def test_a_backend_map_redeclared_by_someone_else_is_repaired_in_the_table(web_objects):
    """The same through the fake table: to redeclare the map, the other party had to empty
    its chain first; the repair deletes and declares it again and refills both."""
    before = rendered(web_objects)
    backend = FakeNft()
    nft, view = edges(backend)
    nft.apply(plan(None, before, "ip", "natgw"))
    ref = {"family": "ip", "table": "natgw"}
    backend.external([{"flush": {"chain": {**ref, "name": "slot_0"}}}, {"delete": {"map": {**ref, "name": "backend_0"}}}])
    backend.external("add map ip natgw backend_0 { type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service; }")
    tampered = view.read()
    assert tampered.sets["backend_0"] != before.sets["backend_0"] and tampered.rules["slot_0"] == ()
    todo = plan(tampered, before, "ip", "natgw")
    assert [p.kind for p in todo.phases] == [PREPARE, DECLARE, MAIN]
    assert todo.phases[0].commands == ({"delete": {"map": {**ref, "name": "backend_0"}}},)
    nft.apply(todo)
    assert view.read() == before  # repaired, and nothing else touched on the way
    assert len(backend.batches) == 3 and len(backend.texts) == 2  # the first sync's two, the repair's three


def test_where_json_declares_every_map_the_plan_is_one_transaction(web_objects):
    """nft >= 1.1.0 (agent/kernel/caps.py probes it): the backend maps in JSON, as a list of data
    types, first after the table as the text declarations would be: one transaction."""
    todo = plan(None, rendered(web_objects), "ip", "natgw", text_maps=False)
    assert [p.kind for p in todo.phases] == [MAIN] and todo.phases[0].commands == todo.commands
    assert todo.commands[0] == {"add": {"table": {"family": "ip", "name": "natgw"}}}
    maps = [c["add"]["map"] for c in todo.commands[1:4]]
    assert [m["name"] for m in maps] == ["backend_0", "backend_1", "backend_2"]
    assert all(m["map"] == ["ipv4_addr", "inet_service"] for m in maps)
    texted = plan(None, rendered(web_objects), "ip", "natgw")
    assert len(todo.commands) == len(texted.commands)  # the same change either way


def test_a_large_plan_that_only_adds_goes_in_parts_of_whole_identities():
    from agent.core.plan import PART, chunked, element_count
    from tests.builders import eip

    objects = [eip("eip-web", "172.18.0.10")] + [rule(f"r{i}-{b}", 1000 + i, f"10.0.{b}.{i % 250 + 1}")
                                                for i in range(300) for b in range(4)]
    whole = plan(None, rendered(objects), "ip", "natgw")
    parts = chunked(whole, 400)
    assert parts.commands == whole.commands  # the same change, as render and diff print it
    kinds = [p.kind for p in parts.phases]
    assert kinds[0] == DECLARE and kinds[-1] == MAIN and set(kinds[1:-1]) == {PART} and len(kinds) >= 5
    seen: dict[str, int] = {}
    for n, phase in enumerate(parts.phases[1:]):
        assert element_count(phase.commands) <= 400
        assert (n == 0) is any("chain" in c["add"] or "rule" in c["add"] or "map" in c["add"] for c in phase.commands)
        for c in phase.commands:
            for entry in c["add"].get("element", {}).get("elem", ()):
                key = json.dumps(entry[0]["elem"]["val"] if "elem" in entry[0] else entry[0])
                assert seen.setdefault(key, n) == n  # every element of an identity in one transaction
    assert len(seen) == 300
    nft, view = edges(FakeNft())
    nft.apply(parts)
    assert view.read() == rendered(objects)
    assert chunked(whole, 10_000) == whole  # small enough: one transaction
    changed = plan(rendered(objects), rendered(objects[:-4], rendered(objects)), "ip", "natgw")
    assert chunked(changed, 1) == changed  # anything that deletes stays one transaction


def test_a_large_clientip_plan_makes_its_buckets_reachable_in_its_last_part():
    """The consistent chain's rule (the only way to the chash maps) comes in the last
    part, so earlier commits do not make the kernel walk the buckets loaded so far."""
    from agent.core.layout import CONSISTENT_CHAIN
    from agent.core.plan import chunked
    from tests.builders import eip

    objects = [eip("eip-web", "172.18.0.10")] + [
        rule(f"r{i}-{b}", 1000 + i, f"10.0.{b}.{i % 250 + 1}", affinity="ClientIP", timeout=600)
        for i in range(40) for b in range(3)]
    whole = plan(None, rendered(objects), "ip", "natgw")
    parts = chunked(whole, 500, last=(CONSISTENT_CHAIN,))
    assert parts.commands == whole.commands and len(parts.phases) >= 4

    def jumps(phase):
        return [c for c in phase.commands if c["add"].get("rule", {}).get("chain") == CONSISTENT_CHAIN]
    assert [len(jumps(p)) for p in parts.phases] == [0] * (len(parts.phases) - 1) + [1]
    nft, view = edges(FakeNft())
    nft.apply(parts)
    assert view.read() == rendered(objects)
