"""The agent's own netlink read-back (agent/kernel/nftread.py and its decoders,
agent/kernel/nftobjects.py and agent/kernel/nftrule.py) on recorded kernel answers: no
root, no kernel.

tests/netlinkfx.py says what the recordings hold. Every fixture present is tested; nft
1.0.6's and a 1.1.x one must be there (nothing here skips)."""
from __future__ import annotations

import copy
import dataclasses
import random
import re
import struct
from typing import Any

import pytest

from agent.core.ruleset import Elem
from agent.kernel import nfnetlink as nl
from agent.kernel import nftread
from agent.kernel.nftobjects import decode_sets
from agent.kernel import nftuapi as uapi
from tests.netlinkfx import FIXTURES, IP, NFT_106, decoded, is_opaque, load, messages, rendered_examples
from tests.nlmsg import nft_type
from tests.oracles import from_listing


@pytest.fixture(params=FIXTURES, ids=[p.stem for p in FIXTURES], scope="module")
def fixture(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load(request.param)

def test_fixtures_are_there() -> None:
    # Both sides of the cross-version tests: without either they would prove nothing.
    assert NFT_106 in FIXTURES
    assert any(p.name.startswith("nft-1.1.") for p in FIXTURES)


# --- the agent's table ------------------------------------------------------------------

def test_the_examples_decode_to_exactly_the_rendered_table(fixture: dict[str, Any]) -> None:
    state = decoded(fixture, "ip natgw")
    rendered = rendered_examples()
    assert state.ruleset() == rendered
    assert state.sets == rendered.sets and state.rules == rendered.rules  # spelled out for a readable diff


def test_on_nft_106_the_decoding_equals_its_json_listing() -> None:
    """The canonical forms are nft 1.0.6's listing (other versions list differently)."""
    fixture = load(NFT_106)
    for key in ("ip natgw", "ip kube-ovn"):
        assert decoded(fixture, key).ruleset() == from_listing(fixture["tables"][key]["listing"]), key


def test_element_counters_and_affinity_entries(fixture: dict[str, Any]) -> None:
    state = decoded(fixture, "ip natgw")
    keys = {("172.18.0.10", "tcp", 80), ("172.18.0.10", "tcp", 443), ("172.18.0.10", "udp", 53)}
    assert state.counters == {f"backend_{s}": {k: (0, 0) for k in keys} for s in range(3)}
    assert state.entries == {"aff_0": [], "aff_1": [], "aff_2": []}
    assert state.elements["services"][("172.18.0.10", "tcp", 443)] == \
        Elem({"goto": {"target": "aff_t600_n3"}}, "app-443-a,app-443-b,app-443-c")
    assert state.elements["backend_2"][("172.18.0.10", "udp", 53)] == ("10.0.1.13", 5353)  # its own element: data, no comment (ruleset.Elem)


def test_the_dynamic_flag_is_left_out_as_nft_106_lists_it(fixture: dict[str, Any]) -> None:
    state = decoded(fixture, "ip natgw")
    assert state.set_info["aff_0"].flags & uapi.NFT_SET_EVAL  # the kernel has it (the update fills the set)
    assert state.sets["aff_0"] == {"type": ["ipv4_addr", "ipv4_addr", "inet_proto", "inet_service"],
                                   "flags": ["timeout"], "size": 262144}


def test_anonymous_sets_are_not_declarations_but_their_elements_fill_the_rules(fixture: dict[str, Any]) -> None:
    state = decoded(fixture, "ip natgw")
    assert any(i.anonymous for i in state.set_info.values())
    assert not any(name.startswith("__") for name in state.sets)
    (rule,) = state.rules["lb_n3"]
    assert rule["expr"][0]["vmap"]["data"]["set"] == [[i, {"goto": {"target": f"slot_{i}"}}] for i in range(3)]


def test_chain_dumps_are_per_family_and_filtered_here(fixture: dict[str, Any]) -> None:
    """The kernel answers GETCHAIN with every chain of the family (it takes no table
    filter), so the reader keeps only its table's."""
    raw = messages(fixture["tables"]["ip natgw"]["dumps"]["chains"])
    tables = {nl.get_str(m.attrs()[uapi.NFTA_CHAIN_TABLE]) for m in raw}
    assert {"natgw", "kube-ovn", "cov"} <= tables
    assert set(decoded(fixture, "ip natgw").chains) == set(rendered_examples().chains)


def test_sets_and_rules_dumps_are_filtered_by_the_kernel(fixture: dict[str, Any]) -> None:
    d = fixture["tables"]["ip natgw"]["dumps"]
    for kind, attr in (("sets", uapi.NFTA_SET_TABLE), ("rules", uapi.NFTA_RULE_TABLE)):
        assert {nl.get_str(m.attrs()[attr]) for m in messages(d[kind])} == {"natgw"}


# --- the legacy table -------------------------------------------------------------------

def test_the_legacy_table_decodes(fixture: dict[str, Any]) -> None:
    state = decoded(fixture, "ip kube-ovn")
    services = state.elements["service-ips"]
    assert set(services) == {("172.18.0.10", "tcp", 80), ("172.18.0.10", "tcp", 443)}
    assert all(e.value["goto"]["target"].startswith("dnat-") for e in services.values())
    assert state.sets["service-ips"] == {"type": ["ipv4_addr", "inet_proto", "inet_service"], "map": "verdict"}
    affinity = [d for n, d in state.sets.items() if n.startswith("aff-")]
    # declared `flags dynamic,timeout`: nft 1.0.6 gives such a set the size 65535 itself
    assert len(affinity) == 2 and all(d["type"] == "ipv4_addr" and d["flags"] == ["timeout"] for d in affinity)
    assert {c.split("-")[0] for c in state.chains} == {"prerouting", "dnat", "ep"}
    assert state.chains["prerouting"] == {"type": "nat", "hook": "prerouting", "prio": -150, "policy": "accept"}


# --- rules beyond the vocabulary ----------------------------------------------------------

def test_other_rules_are_either_exactly_nfts_or_opaque(fixture: dict[str, Any]) -> None:
    state = decoded(fixture, "ip cov")
    opaque = [r for rules in state.rules.values() for r in rules if is_opaque(r)]
    assert len(opaque) >= 10  # ct, iifname, prefixes, masquerade, anonymous chains, ...
    listed = from_listing(fixture["tables"]["ip cov"]["listing"])
    assert state.chains == listed.chains and state.elements == listed.elements
    if fixture["nft_version"] == "1.0.6":  # newer versions list set declarations otherwise (`dynamic`, typeof)
        assert state.sets == listed.sets
    for chain, rules in listed.rules.items():
        mine = state.rules[chain]
        assert len(mine) == len(rules), chain
        for theirs, ours in zip(rules, mine):
            assert ours == theirs or is_opaque(ours), (chain, theirs, ours)
    exact = sum(1 for c, rules in listed.rules.items() for t, o in zip(rules, state.rules[c]) if t == o)
    assert exact >= 20


def test_the_protocol_dependency_nft_hides_makes_a_rule_opaque(fixture: dict[str, Any]) -> None:
    """`meta l4proto tcp th dport 80` is listed as `tcp dport 80` (the match elided):
    rebuilt expression by expression it would differ, so it is opaque."""
    rules = decoded(fixture, "ip cov").rules["c_in"]
    assert is_opaque(rules[0]) and is_opaque(rules[1])
    assert rules[2] == {"expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "th", "field": "dport"}},
                                            "right": 80}}, {"accept": None}]}


def test_an_opaque_rule_never_equals_a_rendered_one(fixture: dict[str, Any]) -> None:
    rendered = [r for rules in rendered_examples().rules.values() for r in rules]
    for rules in decoded(fixture, "ip cov").rules.values():
        for r in rules:
            if is_opaque(r):
                assert r not in rendered
                assert isinstance(r["expr"][0]["opaque"], str) and r["expr"][0]["opaque"]


# --- corrupt input never raises -----------------------------------------------------------

def _cut(m: nl.Message, end: int) -> nl.Message:
    return m._replace(end=end)


def _all_messages(fx: dict[str, Any]) -> list[tuple[str, nl.Message]]:
    """Every recorded message, but of the 61 bucket maps and chains alike only the first
    two's (the rest differ in a number only, and cut 40 ways each cost a minute)."""
    out = []
    for t in fx["tables"].values():
        d = t["dumps"]
        for kind in ("sets", "chains", "rules"):
            out += [(kind, m) for m in messages(d[kind]) if not _a_later_bucket(m)]
        out += [("elements:" + n, m) for n, v in d["elements"].items() for m in messages(v)
                if not _LATER_BUCKET.fullmatch(n)]
    return out


_LATER_BUCKET = re.compile(r"(chash|bucket)_([2-9]|\d\d+)")


def _a_later_bucket(m: nl.Message) -> bool:
    """A set, chain or rule message naming a bucket map or chain beyond the first two."""
    return any(_LATER_BUCKET.fullmatch(name) for name in re.findall(rb"(?:chash|bucket)_\d+", m.buf[m.start:m.end])
               for name in [name.decode()])


def _assemble_one(kind: str, m: nl.Message, fx: dict[str, Any]) -> nftread.TableState:
    base = fx["tables"]["ip natgw"]["dumps"]
    sets = messages(base["sets"])
    if kind == "sets":
        return nftread.assemble(IP, "natgw", [m], {}, [], [])
    infos = _DECODED.get(fx["nft_version"])
    if infos is None:  # the table's sets, decoded once per fixture, not once per cut message
        infos = _DECODED[fx["nft_version"]] = decode_sets(sets)
    if kind == "chains":
        return nftread.assemble(IP, "natgw", sets, {}, [m], [], infos=dict(infos))
    if kind == "rules":
        return nftread.assemble(IP, "natgw", sets, {}, [], [m], infos=dict(infos))
    name = kind.split(":", 1)[1]
    return nftread.assemble(IP, "natgw", sets, {name: [m]}, [], [], infos=dict(infos))


_DECODED: dict[str, dict[str, Any]] = {}  # by the fixture's nft version


def _assert_one_object_in_canonical_form(kind: str, state: nftread.TableState) -> None:
    """What one message, however damaged, may decode to: at most the one object it
    carries (a rule, a chain, a set, or one set's elements), each in the forms render.py
    writes or marked opaque; never a rule without statements."""
    for rules in state.rules.values():
        for rule in rules:
            assert set(rule) <= {"expr", "comment"} and isinstance(rule["expr"], list) and rule["expr"], rule
            assert all(isinstance(e, dict) and e for e in rule["expr"]), rule
            assert all(isinstance(e["opaque"], str) and e["opaque"] for e in rule["expr"] if "opaque" in e), rule
    assert all(isinstance(d, dict) for d in (*state.sets.values(), *state.chains.values()))
    assert all(isinstance(k, tuple) for e in state.elements.values() for k in e)
    assert all(isinstance(k, tuple) for e in state.entries.values() for k, _ in e)
    if kind == "rules":
        assert sum(map(len, state.rules.values())) <= 1 and not state.chains
    elif kind == "chains":
        assert len(state.chains) <= 1 and not any(state.rules.values())
    elif kind == "sets":
        assert len(state.sets) <= 1 and not state.rules
    else:  # one set's elements: nothing lands in another set
        name = kind.split(":", 1)[1]
        assert {n for n, e in state.elements.items() if e} | {n for n, e in state.entries.items() if e} <= {name}


def test_truncated_messages_decode_without_raising(fixture: dict[str, Any]) -> None:
    for kind, m in _all_messages(fixture):
        step = max(1, (m.end - m.start) // 40)
        for end in range(m.start, m.end, step):
            _assert_one_object_in_canonical_form(kind, _assemble_one(kind, _cut(m, end), fixture))


def test_garbled_messages_decode_without_raising(fixture: dict[str, Any]) -> None:
    """Random bytes changed in one message: it decodes to at most its one object, in
    canonical form or marked opaque (a decoder that made up objects, or a rule without
    statements, fails here)."""
    rng = random.Random(7)
    msgs = _all_messages(fixture)
    for _ in range(3000):
        kind, m = rng.choice(msgs)
        buf = bytearray(m.buf)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(m.start, m.end)
            buf[i] = rng.randrange(256)
        state = _assemble_one(kind, m._replace(buf=bytes(buf)), fixture)
        assert isinstance(state, nftread.TableState)
        _assert_one_object_in_canonical_form(kind, state)


def test_a_truncated_datagram_is_a_typed_error() -> None:
    raw = bytes.fromhex(load(FIXTURES[0])["tables"]["ip natgw"]["dumps"]["sets"][0])
    with pytest.raises(nl.MalformedError):
        list(nl.split_messages(raw[:-3]))
    assert list(nl.split_messages(raw[:10])) == []  # less than a header: nothing


def test_a_malformed_rule_is_opaque_and_a_malformed_element_is_marked() -> None:
    fx = load(FIXTURES[0])
    rule = messages(fx["tables"]["ip natgw"]["dumps"]["rules"])[0]
    sets = messages(fx["tables"]["ip natgw"]["dumps"]["sets"])
    buf = bytearray(rule.buf)
    # corrupt the length of the first expression inside NFTA_RULE_EXPRESSIONS
    for t, a, b in nl.iter_attrs(rule.buf, rule.start, rule.end):
        if t == uapi.NFTA_RULE_EXPRESSIONS:
            struct.pack_into("=H", buf, a + 4, 0xFFF0)
    state = nftread.assemble(IP, "natgw", sets, {}, messages(fx["tables"]["ip natgw"]["dumps"]["chains"]),
                             [rule._replace(buf=bytes(buf))])
    assert is_opaque(state.rules["prerouting"][0])
    elems = messages(fx["tables"]["ip natgw"]["dumps"]["elements"]["services"])[0]
    state = nftread.assemble(IP, "natgw", sets, {"services": [_cut(elems, elems.end - 5)]}, [], [])
    assert any(k[0] == "<malformed>" for k in state.elements["services"])


# --- the consistency rule of read_table -----------------------------------------------------

def _note(msg: int, family: int, table: str | None, gen: int | None = None, portid: int = 99) -> nl.Message:
    payload = nl.attr_str(1, table) if table is not None else b""
    if gen is not None:
        payload = nl.attr_be32(uapi.NFTA_GEN_ID, gen)
    raw = nl.build_message(nft_type(msg), 0, 0, family, payload)
    raw = raw[:12] + struct.pack("=I", portid) + raw[16:]
    (m,) = nl.split_messages(raw)
    return m


class _FakeSubscriber:
    def __init__(self, batches: list[list[nl.Message]]) -> None:
        self.batches = batches

    def drain(self) -> nl.Drained:
        return nl.Drained(self.batches.pop(0) if self.batches else [], False)

    def wait(self, timeout: float) -> bool:
        return False


def test_a_moved_generation_is_fine_when_only_other_tables_changed() -> None:
    neighbour = [_note(uapi.NFT_MSG_NEWSETELEM, IP, "other"), _note(uapi.NFT_MSG_NEWGEN, 0, None, gen=11),
                 _note(uapi.NFT_MSG_NEWSETELEM, IP, "other"), _note(uapi.NFT_MSG_NEWGEN, 0, None, gen=12)]
    assert nftread._consistent(_FakeSubscriber([neighbour]), nftread.Commits(), 0, IP, "natgw", 10, 12, 0.2)


def test_a_change_of_our_table_meanwhile_means_read_again() -> None:
    ours = [_note(uapi.NFT_MSG_NEWSETELEM, IP, "natgw"), _note(uapi.NFT_MSG_NEWGEN, 0, None, gen=11)]
    assert not nftread._consistent(_FakeSubscriber([ours]), nftread.Commits(), 0, IP, "natgw", 10, 11, 0.2)
    other_family = [_note(uapi.NFT_MSG_NEWSETELEM, uapi.FAMILIES["inet"], "natgw"), _note(uapi.NFT_MSG_NEWGEN, 0, None, gen=11)]
    assert nftread._consistent(_FakeSubscriber([other_family]), nftread.Commits(), 0, IP, "natgw", 10, 11, 0.2)


def test_a_commit_before_the_pass_does_not_count_and_missing_notifications_mean_unsure() -> None:
    batches = nftread.Commits()
    batches.add([_note(uapi.NFT_MSG_NEWRULE, IP, "natgw"), _note(uapi.NFT_MSG_NEWGEN, 0, None, gen=9)])  # before gen0
    mark = len(batches.commits)
    later = [_note(uapi.NFT_MSG_NEWGEN, 0, None, gen=10)]
    assert nftread._consistent(_FakeSubscriber([later]), batches, mark, IP, "natgw", 10, 10, 0.2)
    # the generation moved to 12 but its NEWGEN never came within `settle`: not sure
    assert not nftread._consistent(_FakeSubscriber([later]), nftread.Commits(), 0, IP, "natgw", 10, 12, 0.05)
    assert nftread._consistent(None, nftread.Commits(), 0, IP, "natgw", 10, 10, 0.05)
    assert not nftread._consistent(None, nftread.Commits(), 0, IP, "natgw", 10, 11, 0.05)


def test_generations_compare_across_wraparound() -> None:
    assert nftread.gen_after(3, 0xFFFFFFFE) and not nftread.gen_after(0xFFFFFFFE, 3)


def test_table_state_equality_ignores_the_generation(fixture: dict[str, Any]) -> None:
    a = decoded(fixture, "ip natgw")
    b = copy.copy(a)
    object.__setattr__(b, "generation", a.generation + 5)
    assert a == b


# --- across nftables versions ---------------------------------------------------------------

def _by_version() -> dict[str, dict[str, Any]]:
    versions = {fx["nft_version"]: fx for fx in map(load, FIXTURES)}
    assert "1.0.6" in versions and any(v.startswith("1.1.") for v in versions)  # one version alone compares nothing
    return versions


@pytest.mark.parametrize("key", ["ip natgw", "ip kube-ovn", "ip cov"])
def test_tables_written_by_each_nft_version_decode_alike(key: str) -> None:
    """The kernel holds the same bytecode, flags and elements whichever nft wrote them
    (only set userdata differs), so the read-back is version-free."""
    states = {v: decoded(fx, key) for v, fx in _by_version().items()}
    # a timeout set's entries expire in what was left when it was recorded (ms apart)
    states = {v: dataclasses.replace(s, entries={n: [k for k, _ in e] for n, e in s.entries.items()})
              for v, s in states.items()}
    first = next(iter(states.values()))
    assert all(s == first for s in states.values()), sorted(states)


def test_newer_listings_are_what_differed() -> None:
    """What made the old read-back fail on nft 1.1.x: its listing says `dynamic` for sets
    an update fills and lists a concatenated map type as a list; the rules and elements
    it lists are the same."""
    rendered = rendered_examples()
    for version, fx in _by_version().items():
        listed = from_listing(fx["tables"]["ip natgw"]["listing"])
        assert listed.rules == rendered.rules and listed.elements == rendered.elements and listed.chains == rendered.chains
        if version == "1.0.6":
            assert listed.sets == rendered.sets
        else:
            assert listed.sets != rendered.sets
            assert "dynamic" in listed.sets["aff_0"]["flags"] and listed.sets["backend_0"]["map"] == ["ipv4_addr", "inet_service"]


def test_elements_can_be_left_out(fixture: dict[str, Any]) -> None:
    t = fixture["tables"]["ip natgw"]["dumps"]
    anonymous = {n: messages(v) for n, v in t["elements"].items() if n.startswith("__")}  # what dump_table reads
    state = nftread.assemble(IP, "natgw", messages(t["sets"]), anonymous, messages(t["chains"]),
                             messages(t["rules"]), elements=False)
    assert state.sets == rendered_examples().sets and state.rules == rendered_examples().rules
    assert state.elements == {} and state.counters == {} and state.entries == {}
