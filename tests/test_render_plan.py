"""Rendering against golden files, slot stability, and what a plan costs."""
import json

from agent.desired import desired_services
from agent.dirsource import DirectorySource
from agent.model import Backend, Identity, build_inventory
from agent.plan import document, plan, retire, stale_chains
from agent.render import assign_slots, parse_target, pattern_chain, render, slots_of, sticky_slots
from agent.ruleset import EMPTY, Ruleset
from agent.settings import Settings
from agent.nft import Nft
from tests.conftest import ROOT, check_golden, rule
from tests.test_incremental import Accepting

S = Settings()


def rendered(objects, previous: Ruleset = EMPTY) -> Ruleset:
    services = desired_services(build_inventory(objects, "gw1").rules, S.max_backends).services
    return render(services, previous, S.affinity_set_size, S.priority)


def test_examples_render_matches_golden():
    source = DirectorySource(ROOT / "examples")
    source.poll()
    check_golden(ROOT / "rulesets" / "examples.json", document(plan(None, rendered(source.objects()), "ip", "natgw")))


def test_hole_after_backend_removal_matches_golden(web_objects):
    before = rendered(web_objects)
    after = rendered([o for o in web_objects if o["metadata"]["name"] != "web-b"], before)
    check_golden(ROOT / "rulesets" / "backend-removed.plan.json", document(plan(before, after, "ip", "natgw")))


def test_no_change_plans_nothing(web_objects):
    first = rendered(web_objects)
    assert plan(first, rendered(web_objects, first), "ip", "natgw") == []


def test_fresh_table_plan_creates_table_then_everything(web_objects):
    cmds = plan(None, rendered(web_objects), "ip", "natgw")
    assert cmds[0] == {"add": {"table": {"family": "ip", "name": "natgw"}}}
    assert not any("delete" in c or "flush" in c for c in cmds)


def test_one_backend_change_touches_only_its_identity(web_objects):
    before = rendered(web_objects)
    changed = [o for o in web_objects if o["metadata"]["name"] != "web-c"] + [rule("web-d", 80, "10.0.1.14")]
    cmds = plan(before, rendered(changed, before), "ip", "natgw")
    # Only element operations, all on 172.18.0.10:80/tcp; no chain or set is touched.
    assert cmds and all(set(c[next(iter(c))]) == {"element"} for c in cmds)
    keys = {json.dumps(e) for c in cmds for e in c[next(iter(c))]["element"]["elem"]}
    assert all('"172.18.0.10", "tcp", 80]' in k for k in keys), keys
    assert len(cmds) == 4  # delete addr/port of the old backend; add addr/port of the new one in its slot


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

    assert assign_slots({web: Svc}, {web: {a: 3, b: 0}}) == {web: {a: 3, c: 0}}


def test_clientip_change_of_other_backend_keeps_affinity_set_and_chain(web_objects):
    before = rendered(web_objects)
    after = rendered(web_objects + [rule("app-c", 443, "10.0.1.13", 9090, affinity="ClientIP", timeout=600)], before)
    cmds = plan(before, after, "ip", "natgw")
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
    cmds = plan(before, after, "ip", "natgw")
    deleted = {next(iter(c["delete"].values()))["name"] for c in cmds if "delete" in c and "element" not in c["delete"]}
    flushed = {c["flush"]["chain"]["name"] for c in cmds if "flush" in c}
    assert deleted == {"backend_0", "backend_1", "backend_2", "aff_0", "aff_1"}
    chains = {"slot_0", "slot_1", "slot_2", "lb_n3", "lb_n1", "aff_t600_n2", "sticky_0_t600", "sticky_1_t600"}
    assert flushed == chains  # emptied in this transaction ...
    assert set(stale_chains(before, after)) == chains
    assert {c["delete"]["chain"]["name"] for c in retire(sorted(chains), "ip", "natgw")} == chains  # ... deleted later
    assert after.elements["services"] == {}
    assert plan(after, rendered([web_objects[0]], after), "ip", "natgw") == []


def test_pattern_chain_names():
    assert pattern_chain((0, 1, 2), None) == "lb_n3"
    assert pattern_chain((0, 2), 600) == "aff_t600_s0.2"
    long = pattern_chain(tuple(range(1, 200)), None)
    assert long.startswith("lb_h") and len(long) < 64
    for name in ("lb_n3", "aff_t600_s0.2", long):
        assert parse_target(name) is not None
    assert parse_target("prerouting") is None


def test_declaration_change_redeclares_in_the_same_transaction(web_objects):
    """A new affinity set size or base chain priority: rules flushed, the changed objects
    deleted and declared anew, everything else (elements, backend maps) kept."""
    before = rendered(web_objects)
    services = desired_services(build_inventory(web_objects, "gw1").rules, 256).services
    after = render(services, before, 1024, S.priority + 1)
    cmds = plan(before, after, "ip", "natgw")
    ref = {"family": "ip", "table": "natgw"}
    assert cmds[:4] == [{"flush": {"table": {"family": "ip", "name": "natgw"}}},
                        {"delete": {"set": {**ref, "name": "aff_0"}}}, {"delete": {"set": {**ref, "name": "aff_1"}}},
                        {"delete": {"chain": {**ref, "name": "prerouting"}}}]
    assert not any("table" in c.get("delete", {}) or "element" in c.get("delete", {}) for c in cmds)
    added = {(k, b.get("name") or b.get("chain")) for c in cmds if "add" in c for k, b in c["add"].items()}
    assert {("set", "aff_0"), ("set", "aff_1"), ("chain", "prerouting")} <= added
    assert not any(k == "map" or k == "element" for k, _ in added)  # maps and their elements stay
    assert len([c for c in cmds if "rule" in c.get("add", {})]) == sum(len(r) for r in after.rules.values())
    assert plan(after, after, "ip", "natgw") == []


def test_an_altered_backend_map_is_emptied_of_its_users_and_redeclared(web_objects):
    """Someone else redeclared a map that only nft text can declare: the chain using it is
    emptied and the map deleted first, then it is declared in text and the rest follows;
    nothing else (other slots, affinity sets, the table) is touched."""
    before = rendered(web_objects)
    tampered = Ruleset({**before.sets, "backend_0": {**before.sets["backend_0"], "stmt": []}},
                       before.chains, before.rules, before.elements)
    cmds = plan(tampered, before, "ip", "natgw")
    ref = {"family": "ip", "table": "natgw"}
    assert cmds[:2] == [{"flush": {"chain": {**ref, "name": "slot_0"}}}, {"delete": {"map": {**ref, "name": "backend_0"}}}]
    touched = {(verb, kind, body.get("name") or body.get("chain")) for c in cmds for verb, o in c.items() for kind, body in o.items()}
    assert touched == {("flush", "chain", "slot_0"), ("delete", "map", "backend_0"), ("add", "map", "backend_0"),
                       ("add", "rule", "slot_0"), ("add", "element", "backend_0")}
    backend = Accepting()
    Nft("ip", "natgw", backend).apply(cmds)
    first, rest = backend.batches
    assert first == cmds[:2] and len(backend.texts) == 1 and "backend_0" in backend.texts[0]
    assert rest == [c for c in cmds[2:] if "map" not in c.get("add", {})]


def test_rule_names_reach_comments_truncated(web_objects):
    many = web_objects + [rule(f"web-extra-{i:03d}-with-a-long-name", 80, "10.0.1.11") for i in range(20)]
    rs = rendered(many)
    comment = rs.elements["services"][("172.18.0.10", "tcp", 80)].comment
    assert len(comment) <= 128 and comment.endswith("more")
    assert rs.elements["backend_1"][("172.18.0.10", "tcp", 80)].comment is None  # names only on services: see README
