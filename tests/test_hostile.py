"""Hostile input: arbitrary objects thrown at the model, the incremental desired state and
the render -> plan path. Nothing may raise, every refusal must name its object and field,
and nothing syntax-shaped (or merely invalid) may reach the JSON sent to libnftables.

The oracles here are independent of the code under test: the stdlib `ipaddress` module
for addresses, plain integer ranges for ports and timeouts, a DNS-1123 regex for names,
and a full walk of the rendered JSON tree."""
from __future__ import annotations

import ipaddress
import json
import math
import os
import random
import re
from pathlib import Path
from typing import Any, Iterable

import pytest
import yaml
from hypothesis import HealthCheck, example, given, note, settings as hsettings, strategies as st

from agent.desired import DesiredState, ListCatalog, desired_services
from agent.dirsource import DirectorySource
from agent.errors import RuleError
from agent.model import EIP_KIND, RULE_KIND, Backend, Identity, Rule, build_inventory
from agent.nft import Nft
from agent.plan import document, plan
from agent.reconcile import Reconciler
from agent.render import BACKEND_DATA, render
from agent.ruleset import EMPTY
from agent.settings import Settings
from tests.conftest import eip, rule
from tests.test_incremental import Accepting

GW = "gw1"
MAX_BACKENDS = 256
SET_SIZE = 262144
PRIORITY = -160
SETTINGS = Settings(gateway=GW, conntrack=False)
HYPO = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------------------------ oracles

DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
COMMENT = re.compile(r"(?:[a-z0-9.-]+(?:,[a-z0-9.-]+)*)?(?:,\+[1-9][0-9]* more)?")
IDENT = re.compile(r"@?[a-z0-9_.]+")  # chain, set, map and table names, references
ADDRESS_SHAPED = re.compile(r"[0-9a-fA-F:.]*[0-9][0-9a-fA-F:.]*")
FORBIDDEN = set(";\n\r{}\x00")


def valid_ipv4(value: Any) -> bool:
    """A dotted-quad IPv4 unicast address, as the stdlib sees it."""
    if not isinstance(value, str):
        return False
    try:
        addr = ipaddress.IPv4Address(value)
    except ValueError:
        return False
    return (str(addr) == value and not addr.is_multicast and not addr.is_loopback and not addr.is_unspecified
            and addr != ipaddress.IPv4Address("255.255.255.255"))


def valid_port(value: Any) -> bool:
    return type(value) is int and 1 <= value <= 65535


def valid_name(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= 253 and DNS1123.fullmatch(value) is not None


def check_errors(errors: Iterable[Any]) -> None:
    for err in errors:
        assert isinstance(err, RuleError), err
        assert err.kind in (RULE_KIND, EIP_KIND), err
        assert isinstance(err.name, str) and err.name, f"error names no object: {err!r} ({err.field}: {err.reason})"
        assert isinstance(err.field, str) and err.field.startswith(("spec.", "metadata.", "status.")), err
        assert isinstance(err.reason, str) and err.reason, err
        assert str(err)  # renders


def check_rule(r: Any) -> None:
    assert isinstance(r, Rule), r
    assert valid_name(r.name), r
    assert valid_ipv4(r.identity.eip), r
    assert valid_ipv4(r.backend.ip), r
    assert valid_port(r.identity.port) and valid_port(r.backend.port), r
    assert r.identity.proto in ("tcp", "udp"), r
    assert type(r.affinity) is bool, r
    assert type(r.timeout) is int and 1 <= r.timeout <= 86400, r


def check_commands(commands: list[dict[str, Any]], accepted: set[str]) -> None:
    """Walk the whole transaction: every string safe, every address and port valid."""
    try:
        text = json.dumps({"nftables": commands}, allow_nan=False)
    except ValueError as exc:  # NaN or Infinity: libnftables would choke on the document
        raise AssertionError(f"not strict JSON: {exc}") from None
    assert json.loads(document(commands)) == json.loads(text)

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        where = "/".join(map(str, path))
        if isinstance(node, dict):
            for k, v in node.items():
                assert isinstance(k, str) and IDENT.fullmatch(k), f"key {k!r} at {where}"
                walk(v, (*path, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, i))
        elif isinstance(node, str):
            assert not FORBIDDEN & set(node), f"syntax-shaped string {node!r} at {where}"
            assert node.isascii() and node.isprintable(), f"non-printable or non-ASCII {node!r} at {where}"
            last = path[-1] if path else None
            if last == "comment":
                assert 0 < len(node) <= 128 and COMMENT.fullmatch(node), f"comment {node!r} at {where}"
                names = [n for n in node.split(",") if n and not n.startswith("+")]
                assert all(valid_name(n) for n in names) and set(names) <= accepted, f"comment {node!r} at {where}"
            elif last == "map":  # a map's data type: declared in nft text if concatenated (nft.py)
                assert node in ("verdict", BACKEND_DATA), f"map data type {node!r} at {where}"
            elif last in ("name", "table", "chain", "target", "set", "data"):
                assert IDENT.fullmatch(node) and len(node) <= 256, f"identifier {node!r} at {where}"
            elif ADDRESS_SHAPED.fullmatch(node):
                assert valid_ipv4(node), f"address-shaped {node!r} at {where}"
        elif node is None or isinstance(node, bool):
            pass
        elif isinstance(node, int):
            assert -(2**31) <= node < 2**32, f"int {node} at {where}"
            if path and path[-1] == "timeout":
                assert 1 <= node <= 86400, f"timeout {node} at {where}"
            if path and path[-1] == "prio":
                assert node == PRIORITY
            if path and path[-1] == "size":
                assert node == SET_SIZE
        else:
            raise AssertionError(f"{type(node).__name__} {node!r} at {where}")

    walk(commands, ())
    for command in commands:
        for verb, body in command.items():
            element = body.get("element") if isinstance(body, dict) else None
            if element is None:
                continue
            assert element["family"] == "ip" and element["table"] == "natgw"
            for item in element["elem"]:
                key, value = item if verb == "add" else (item, None)
                if isinstance(key, dict) and "elem" in key:
                    key = key["elem"]["val"]
                eip_addr, proto, port = key["concat"]
                assert valid_ipv4(eip_addr) and proto in ("tcp", "udp") and valid_port(port), key
                if verb != "add":
                    continue
                name = element["name"]
                if name.startswith("backend_"):
                    address, backend_port = value["concat"]
                    assert valid_ipv4(address) and valid_port(backend_port), (name, value)
                else:
                    assert name == "services", name
                    assert re.fullmatch(r"(lb|aff_t[0-9]+)_(n[0-9]+|s[0-9.]+|h[0-9a-f]+)", value["goto"]["target"])


def pipeline(objects: list[Any]) -> tuple[Any, Any, list[dict[str, Any]]]:
    """model -> desired -> render -> plan, with every property checked on the way."""
    inventory = build_inventory(objects, GW)
    check_errors(inventory.errors)
    for r in inventory.rules:
        check_rule(r)
    desired = desired_services(inventory.rules, MAX_BACKENDS)
    check_errors(desired.errors)
    for identity, service in desired.services.items():
        assert len(service.backends) <= MAX_BACKENDS
        assert service.timeout == 0 if not service.affinity else 1 <= service.timeout <= 86400
    # The incremental state's full path lands on the same result.
    state = DesiredState(GW, MAX_BACKENDS)
    state.rebuild(ListCatalog(objects))
    assert state.services == desired.services
    assert sorted(e.key() for e in state.errors) == sorted(e.key() for e in (*inventory.errors, *desired.errors))
    assert state.notes == list(desired.notes)
    commands = plan(None, render(desired.services, EMPTY, SET_SIZE, PRIORITY), "ip", "natgw")
    check_commands(commands, {r.name for r in inventory.rules})
    return inventory, desired, commands


# --------------------------------------------------------------------------- strategies

NFT_SYNTAX = [
    "1.2.3.4; flush ruleset", "tcp dport 80 drop", "} ; add table ip evil { }", "10.0.1.11\nflush ruleset",
    "10.0.1.11 } ; add table", "@services", "$evil", "goto lb_n3", "flush ruleset", "80;", "80 } ;",
    '"quoted"', "ip natgw", "# comment", "10.0.1.11 counter drop", "accept", "{", "}", ";", "\\n",
]
UNICODE = [
    "\uff11\uff10.0.1.11", "\uff18\uff10", "\u0668\u0660", "\u202e08", "web\u200f-a", "\u200bweb-a", "\U0001F600",
    "\U0001F680.example", "\uff57\uff45\uff42-a", "\uff34\uff23\uff30", "tcp\u200b", "\u0130", "Clientip",
    "ClientIP\u200e", "caf\u00e9", "\ufeff80", "\u00b9\u00b2\u00b3",
]
CONTROL = ["\x00", "10.0.1.11\x00", "80\x00", "\t80", "80\n", " 80", "web-a\r", "\x7f", "\x1b[31mred", "\x08"]
ADDRESSES = [
    "::1", "fe80::1", "2001:db8::1", "::ffff:10.0.1.11", "::", "10.0.1.256", "10.0.1", "10.0.1.11.5", "010.0.1.11",
    "10.0.1.011", "0x0a.0.0.1", "10.0.1.11/32", " 10.0.1.11", "10.0.1.11 ", "0.0.0.0", "255.255.255.255", "127.0.0.1",
    "127.1.2.3", "224.0.0.1", "239.255.255.255", "1e3.0.0.1", "10.0.1.-1", "", "localhost", "10.0.1.11\n", "167837963",
    "10.0.1.11:8080", "1.2.3.4; flush ruleset",
]
PORT_STRINGS = ["0", "-1", "65536", "99999", "100000", "1" + "0" * 30, "80.0", "0x50", "+80", "8_0", "80 ", "1e2",
                "", "00080", "080", "65535", "1", "\uff18\uff10", "\u0668\u0660", "80;", "80 drop"]
PORT_INTS = [0, -1, 65536, 10**30, -(10**30), 1, 65535, 2**63, 2**64 + 80, 80]
FLOATS = [80.0, 0.5, -1.0, math.nan, math.inf, -math.inf, 1e308, 443.0]

hostile_str = st.one_of(st.sampled_from(NFT_SYNTAX + UNICODE + CONTROL + ADDRESSES + PORT_STRINGS),
                        st.text(max_size=12))
hostile_scalar = st.one_of(
    st.none(), st.booleans(), st.sampled_from(PORT_INTS), st.integers(), st.sampled_from(FLOATS),
    st.floats(allow_nan=True), hostile_str,
)
hostile = st.recursive(
    hostile_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(hostile_str, inner, max_size=3)),
    max_leaves=6,
)

GOOD_RULE_NAME, GOOD_EIP_NAME = "good-rule", "eip-good"
LONG_NAMES = ["r" + "x" * 60 + "-1", "r" + "x" * 60 + "-2", "a" * 253, "b" * 63 + "." + "c" * 63]
RULE_NAMES = ["web-a", "web-b", "web-c", "app.x", "a", "1.2.3.4", *LONG_NAMES, GOOD_RULE_NAME]
BAD_NAMES = ["", "Web-A", "web_a", "-web", "web-", "a" * 254, "a..b", "web-a; flush ruleset", "web-a\n",
             "\uff57\uff45\uff42-a", "web\u202ea", "\U0001F600", "tcp dport 80 drop", "} ; add table", "web a"]
EIP_NAMES = ["eip-web", "eip-b", "", "eip web", "eip-web; flush ruleset", GOOD_EIP_NAME]
ADDRS = ["172.18.0.10", "172.18.0.20", "10.0.1.11", "10.0.1.12", "10.0.1.13", "192.168.7.1", "0.1.2.3", "223.255.255.254"]


MISSING = object()  # a damaged field may be left out altogether
VALID_PORTS = ["80", 80, "443", 443, "8080", 8080, "53", "65535", 65535, 1, "1", "00080"]

# Per field: what a valid value looks like, and what a hostile one may be (besides anything).
RULE_FIELDS: dict[str, tuple[st.SearchStrategy[Any], list[Any]]] = {
    "eip": (st.sampled_from(["eip-web", "eip-web", "eip-b", GOOD_EIP_NAME]), EIP_NAMES + NFT_SYNTAX[:4]),
    "externalPort": (st.sampled_from(VALID_PORTS), PORT_STRINGS + PORT_INTS + FLOATS + [True, False]),
    "protocol": (st.sampled_from(["tcp", "udp", "TCP", "Udp"]),
                 ["sctp", "icmp", "", "tcp ", "tcp\n", "\uff54cp", "ＴＣＰ", "tcp; drop", "tcp dport 80 drop", 6, 17]),
    "internalIp": (st.sampled_from(ADDRS), ADDRESSES),
    "internalPort": (st.sampled_from(VALID_PORTS), PORT_STRINGS + PORT_INTS + FLOATS + [True, False]),
    "type": (st.just("share"), ["exclusive", "Share", "SHARE", "", "share ", "share; flush ruleset"]),
    "sessionAffinity": (st.sampled_from(["", "ClientIP", None]),
                        ["clientip", "None", "ClientIP ", "ClientIP\u200e", "ClientIP; drop", 1, True]),
    "sessionAffinityTimeoutSeconds": (st.sampled_from([0, 1, 600, 86400, None]),
                                      [86401, -1, "600", 600.0, True, False, 10**30, math.nan, "10800; drop"]),
}
EIP_FIELDS: dict[str, tuple[st.SearchStrategy[Any], list[Any]]] = {
    "v4ip": (st.sampled_from(ADDRS), ADDRESSES),
    "natGwDp": (st.sampled_from(["gw1", "gw1", "gw1", "gw2"]), ["GW1", "gw1 ", "gw1; flush ruleset", "", None, 1]),
    "ip": (st.sampled_from(ADDRS + ["", None]), ADDRESSES),
}


def damaged(bad: list[Any]) -> st.SearchStrategy[Any]:
    """Most often a value known to be wrong for this field, else missing, else anything."""
    return st.integers(0, 5).flatmap(lambda n: st.sampled_from(bad) if n < 4 else st.just(MISSING) if n == 4 else hostile)


@st.composite
def fields_of(draw: st.DrawFn, table: dict[str, tuple[st.SearchStrategy[Any], list[Any]]]) -> dict[str, Any]:
    """A valid set of fields with none, one or a few of them damaged (most often one: so
    each damage is met on an object otherwise good enough to reach its check)."""
    broken = draw(st.sampled_from([1, 0, 1, 0, 2, 1, 3]))
    which = set(draw(st.permutations(list(table)))[:broken])
    values = {k: draw(damaged(bad) if k in which else good) for k, (good, bad) in table.items()}
    return {k: v for k, v in values.items() if v is not MISSING}


names = st.integers(0, 5).flatmap(
    lambda n: st.sampled_from(RULE_NAMES) if n < 4 else st.sampled_from(BAD_NAMES) if n == 4 else hostile)


@st.composite
def wrap(draw: st.DrawFn, kind: str, name: Any, spec: dict[str, Any], status: Any = None) -> Any:
    """An object of `kind`, sometimes damaged at a higher level: kind, metadata, spec, status, the whole."""
    roll = draw(st.integers(0, 29)) - 19  # hypothesis favours 0: make it the undamaged case
    if roll == 0:
        return draw(hostile)  # not even a dict
    obj: dict[str, Any] = {"apiVersion": "kubeovn.io/v1", "kind": kind, "metadata": {"name": name}, "spec": spec}
    if status is not None:
        obj["status"] = status
    if roll == 1:
        obj["kind"] = draw(st.sampled_from([kind.lower(), kind + "List", kind + "; flush ruleset", "List"]) | hostile)
    elif roll == 2:
        obj["metadata"] = draw(hostile)
    elif roll == 3:
        obj["spec"] = draw(st.one_of(st.lists(hostile, max_size=2), hostile_str, st.integers(), st.none(), hostile))
    elif roll == 4:
        obj["status"] = draw(st.one_of(st.lists(hostile, max_size=2), hostile_str, st.none(), hostile))
    elif roll == 5:
        obj["metadata"]["deletionTimestamp"] = draw(st.sampled_from(["2024-05-01T10:00:00Z", "", 0, None]) | hostile)
    elif roll == 6:
        del obj["metadata"]
    elif roll == 7:
        del obj["spec"]
    elif roll == 8:
        obj["metadata"]["uid"] = draw(hostile)
        obj["metadata"]["resourceVersion"] = draw(hostile)
    elif roll == 9:
        obj[draw(hostile_str)] = draw(hostile)
    elif roll == 10:
        obj["spec"] = {**spec, **draw(st.dictionaries(hostile_str, hostile, max_size=2))}  # unknown fields
    return obj


@st.composite
def rule_objects(draw: st.DrawFn, name: st.SearchStrategy[Any] = names) -> Any:
    return draw(wrap(RULE_KIND, draw(name), draw(fields_of(RULE_FIELDS))))


@st.composite
def eip_objects(draw: st.DrawFn, name: st.SearchStrategy[Any] = st.sampled_from(EIP_NAMES) | hostile) -> Any:
    fields = draw(fields_of(EIP_FIELDS))
    status = {"ready": True, **({"ip": fields.pop("ip")} if "ip" in fields else {})}
    return draw(wrap(EIP_KIND, draw(name), fields, status))


GOOD_EIPS = [eip("eip-web", "172.18.0.10"), eip("eip-b", "172.18.0.20"), eip("eip-o", "172.18.0.30", "gw2")]
any_object = st.one_of(rule_objects(), rule_objects(), rule_objects(), eip_objects(), hostile)


@st.composite
def hostile_batches(draw: st.DrawFn) -> list[Any]:
    """Up to 25 objects, most often with valid EIPs among them so that rules get far."""
    objects = draw(st.lists(any_object, min_size=1, max_size=25))
    for good in GOOD_EIPS:
        if draw(st.integers(0, 4)) < 4:
            objects.insert(draw(st.integers(0, len(objects))), good)
    return objects


batches = hostile_batches()


# ------------------------------------------------------------------------------- tests

@hsettings(max_examples=400, **HYPO)
@given(batches)
def test_hostile_batches_never_raise_and_nothing_invalid_is_rendered(objects: list[Any]) -> None:
    pipeline(objects)


@hsettings(max_examples=300, **HYPO)
@given(st.lists(rule_objects(), max_size=20), st.lists(eip_objects(), min_size=1, max_size=4))
def test_rules_and_eips_only(rules: list[Any], eips: list[Any]) -> None:
    """Denser: every object is a (damaged) rule or EIP, so more of them get far."""
    pipeline([*eips, *rules])


VALID_SPEC = {"eip": "eip-web", "externalPort": "80", "protocol": "tcp", "internalIp": "10.0.1.11",
              "internalPort": "8080", "type": "share", "sessionAffinity": "ClientIP", "sessionAffinityTimeoutSeconds": 600}


@hsettings(max_examples=400, **HYPO)
@given(st.sampled_from(list(RULE_FIELDS)).flatmap(lambda f: st.tuples(st.just(f), damaged(RULE_FIELDS[f][1]))))
def test_a_damaged_rule_field_is_named_or_harmless(damage: tuple[str, Any]) -> None:
    """One field of an otherwise valid rule damaged: the rule is refused naming exactly that
    field, or (for ownership fields) is not ours, or the value was acceptable after all."""
    field, value = damage
    spec = {**VALID_SPEC, field: value}
    if value is MISSING:
        del spec[field]
    obj = {"apiVersion": "kubeovn.io/v1", "kind": RULE_KIND, "metadata": {"name": "web-a", "uid": "u1"}, "spec": spec}
    inventory, desired, commands = pipeline([eip("eip-web", "172.18.0.10"), obj])
    if inventory.errors:
        (err,) = inventory.errors
        assert (err.kind, err.name, err.field, err.uid) == (RULE_KIND, "web-a", f"spec.{field}", "u1"), err
        assert inventory.rules == () and desired.services == {} and len(commands) == 4  # the empty table
    elif inventory.rules:
        (r,) = inventory.rules
        assert r.name == "web-a" and len(desired.services) == 1
    else:
        assert field in ("eip", "type"), (field, value)  # pointing elsewhere, or not a share rule: not ours


@hsettings(max_examples=200, **HYPO)
@given(st.one_of(st.sampled_from(BAD_NAMES + RULE_NAMES), hostile))
def test_a_rule_name_is_checked_and_named(name: Any) -> None:
    inventory, _, commands = pipeline([eip("eip-web", "172.18.0.10"), {**rule("x", 80, "10.0.1.11"), "metadata": {"name": name}}])
    if valid_name(name):
        assert [r.name for r in inventory.rules] == [name] and inventory.errors == ()
    elif isinstance(name, str) and name:
        assert [(e.name, e.field) for e in inventory.errors] == [(name, "metadata.name")] and inventory.rules == ()
    else:  # nothing to name it by: not an object at all
        assert inventory.rules == () and inventory.errors == ()


@hsettings(max_examples=300, **HYPO)
@given(st.sampled_from(list(EIP_FIELDS)).flatmap(lambda f: st.tuples(st.just(f), damaged(EIP_FIELDS[f][1]))),
       st.booleans())
def test_a_damaged_eip_field_refuses_its_rules_naming_it(damage: tuple[str, Any], status_ip: bool) -> None:
    field, value = damage
    obj = eip("eip-web", "172.18.0.10")
    if not status_ip:
        del obj["status"]["ip"]  # the address then comes from spec.v4ip
    where = obj["status"] if field == "ip" else obj["spec"]
    if value is MISSING:
        where.pop(field, None)
    else:
        where[field] = value
    inventory, desired, _ = pipeline([obj, rule("web-a", 80, "10.0.1.11"), rule("web-b", 80, "10.0.1.12")])
    if inventory.errors:
        assert [(e.name, e.field) for e in inventory.errors] == [("web-a", "spec.eip"), ("web-b", "spec.eip")]
        assert all("'eip-web'" in e.reason and ("status.ip" in e.reason or "spec.v4ip" in e.reason)
                   for e in inventory.errors), inventory.errors
    elif inventory.rules:
        assert {r.identity.eip for r in inventory.rules} == {"172.18.0.10" if status_ip or field != "v4ip" else value}
    else:
        assert field == "natGwDp", (field, value)  # another gateway's (or nobody's) EIP


def _live_named(obj: Any, kind: str, name: str) -> bool:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return (isinstance(meta, dict) and obj.get("kind") == kind and meta.get("name") == name
            and not meta.get("deletionTimestamp"))


GOOD_EIP = eip(GOOD_EIP_NAME, "172.18.0.99")
GOOD_RULE = rule(GOOD_RULE_NAME, 8443, "10.0.9.9", 9443, eip_name=GOOD_EIP_NAME)
GOOD = Rule(GOOD_RULE_NAME, Identity("172.18.0.99", 8443, "tcp"), Backend("10.0.9.9", 9443), False, 10800)


@hsettings(max_examples=300, **HYPO)
@given(batches, st.randoms(use_true_random=False))
def test_one_bad_object_never_hides_a_good_one(objects: list[Any], rnd: random.Random) -> None:
    mixed = list(objects)
    mixed.insert(rnd.randint(0, len(mixed)), GOOD_EIP)
    mixed.insert(rnd.randint(0, len(mixed)), GOOD_RULE)
    inventory, desired, commands = pipeline(mixed)
    collides = any(_live_named(o, RULE_KIND, GOOD_RULE_NAME) or _live_named(o, EIP_KIND, GOOD_EIP_NAME) for o in objects)
    if collides:  # by design: a name defined twice is used by neither copy
        assert GOOD_RULE_NAME not in {r.name for r in inventory.rules}
        return
    assert GOOD in inventory.rules
    service = desired.services[GOOD.identity]  # siblings may share it (and its affinity), never remove it
    assert GOOD.backend in service.backends and GOOD_RULE_NAME in service.rule_names
    added = [e for c in commands for e in c.get("add", {}).get("element", {}).get("elem", [])
             if c["add"]["element"]["name"].startswith("backend_")]
    assert any(value == {"concat": ["10.0.9.9", 9443]} and key["concat"] == ["172.18.0.99", "tcp", 8443]
               for key, value in added), added


@hsettings(max_examples=200, **HYPO)
@given(batches, st.randoms(use_true_random=False))
@example([{"kind": RULE_KIND, "metadata": {"name": "web-c"}, "spec": {"eip": GOOD_EIP_NAME, "type": "share"}},
          {"kind": RULE_KIND, "metadata": {"name": "web-c"}, "spec": {}}], random.Random(1))  # found by the search
def test_result_does_not_depend_on_object_order(objects: list[Any], rnd: random.Random) -> None:
    """A directory's objects come in file-name order; renaming a file must change nothing."""
    objects = [*objects, GOOD_EIP, GOOD_RULE]
    shuffled = list(objects)
    rnd.shuffle(shuffled)
    a = build_inventory(objects, GW)
    for other in (objects[::-1], shuffled):
        b = build_inventory(other, GW)
        assert set(a.rules) == set(b.rules)
        assert sorted(e.key() for e in a.errors) == sorted(e.key() for e in b.errors)


# Same name twice: neither copy is used and the name is reported, whichever copy comes first.
DUPLICATES = {
    "identical": (rule("web-a", 80, "10.0.1.11"), rule("web-a", 80, "10.0.1.11")),
    "different-backend": (rule("web-a", 80, "10.0.1.11"), rule("web-a", 80, "10.0.1.12")),
    "other-gateway-copy": (rule("web-a", 80, "10.0.1.11"), rule("web-a", 80, "10.0.1.11", eip_name="eip-other")),
    "exclusive-copy": (rule("web-a", 80, "10.0.1.11"), {**rule("web-a", 80, "10.0.1.11"),
                                                         "spec": {**rule("web-a", 80, "10.0.1.11")["spec"], "type": "exclusive"}}),
    "invalid-copy": (rule("web-a", 80, "10.0.1.11"), rule("web-a", 80, "10.0.1.11; flush ruleset")),
    "spec-not-a-dict": (rule("web-a", 80, "10.0.1.11"), {**rule("web-a", 80, "10.0.1.11"), "spec": "web-a"}),
}
EIPS = [eip("eip-web", "172.18.0.10"), eip("eip-other", "172.18.0.11", "gw2")]


@pytest.mark.parametrize("swap", [False, True], ids=["ours-first", "ours-second"])
@pytest.mark.parametrize("case", list(DUPLICATES))
def test_same_rule_name_twice_is_refused_whichever_comes_first(case: str, swap: bool) -> None:
    first, second = DUPLICATES[case]
    pair = [second, first] if swap else [first, second]
    inventory, _, commands = pipeline([*EIPS, rule("web-b", 80, "10.0.1.13"), *pair])
    assert [r.name for r in inventory.rules] == ["web-b"]  # the other rule of the identity lives on
    assert [(e.name, e.field) for e in inventory.errors] == [("web-a", "metadata.name")], inventory.errors


@pytest.mark.parametrize("swap", [False, True], ids=["ours-first", "ours-second"])
def test_same_eip_name_twice_refuses_its_rules_whichever_comes_first(swap: bool) -> None:
    pair = [eip("eip-web", "172.18.0.10"), eip("eip-web", "172.18.0.12", "gw2")]
    inventory, _, _ = pipeline([*(pair[::-1] if swap else pair), rule("web-a", 80, "10.0.1.11")])
    assert inventory.rules == ()
    assert [(e.name, e.field) for e in inventory.errors] == [("web-a", "spec.eip")], inventory.errors
    assert "eip-web" in inventory.errors[0].reason and "more than once" in inventory.errors[0].reason


affinity_members = st.lists(
    st.tuples(st.integers(1, 12), st.sampled_from(["", "ClientIP", None]), st.sampled_from([None, 0, 1, 60, 600, 86400])),
    min_size=1, max_size=12)


@hsettings(max_examples=200, **HYPO)
@given(affinity_members, st.randoms(use_true_random=False))
def test_conflicting_affinity_resolves_to_clientip_with_the_longest_timeout(members: list[Any], rnd: random.Random) -> None:
    objects = [eip("eip-web", "172.18.0.10")]
    for i, (backend, affinity, timeout) in enumerate(members):
        obj = rule(f"r{i}", 443, f"10.0.1.{backend}", 9090, affinity=affinity or "", timeout=timeout)
        if affinity is None:
            obj["spec"]["sessionAffinity"] = None
        objects.append(obj)
    sticky = [t or 10800 for _, a, t in members if a == "ClientIP"]
    results = []
    for _ in range(3):
        shuffled = list(objects)
        rnd.shuffle(shuffled)
        _, desired, commands = pipeline(shuffled)
        (service,) = desired.services.values()
        assert service.affinity == bool(sticky)
        assert service.timeout == (max(sticky) if sticky else 0)
        assert len(service.backends) == len({b for b, _, _ in members})
        mixed = bool(sticky) and (len(sticky) != len(members) or len(set(sticky)) > 1)
        assert len(desired.notes) == mixed and (not mixed or str(max(sticky)) in desired.notes[0])
        results.append((service, commands))
    assert all(r == results[0] for r in results)  # the same whatever the order


def backend_rules(count: int, port: int, prefix: str) -> list[dict[str, Any]]:
    return [rule(f"{prefix}-{i}", port, f"10.1.{i // 250}.{i % 250 + 1}") for i in range(count)]


@pytest.mark.parametrize("count,refused", [(256, False), (257, True), (10_000, True)])
def test_too_many_backends_refuse_the_identity_and_name_every_rule(count: int, refused: bool) -> None:
    big = backend_rules(count, 81, "big")
    others = [rule("web-a", 80, "10.0.1.11"), rule("web-b", 80, "10.0.1.12"), rule("web-c", 80, "10.0.1.13"),
              rule("dns-a", 81, "10.0.1.12", 5353, proto="udp")]  # same port, other protocol
    junk = [rule("junk-1", 81, "10.0.1.11; flush ruleset"), {"kind": RULE_KIND, "metadata": "x"}, None, 81]
    objects = [eip("eip-web", "172.18.0.10"), *others, *big, *junk]
    inventory, desired, commands = pipeline(objects)
    identity = Identity("172.18.0.10", 81, "tcp")
    assert set(desired.services) == {Identity("172.18.0.10", 80, "tcp"), Identity("172.18.0.10", 81, "udp")} | (
        set() if refused else {identity})
    assert len(desired.services[Identity("172.18.0.10", 80, "tcp")].backends) == 3
    assert [(e.name, e.field) for e in inventory.errors] == [("junk-1", "spec.internalIp")]
    if not refused:
        assert desired.errors == ()
        return
    assert sorted(e.name for e in desired.errors) == sorted(r["metadata"]["name"] for r in big)
    for err in desired.errors:
        assert err.kind == RULE_KIND and err.field == "spec.internalIp"
        assert str(identity) in err.reason and "limit" in err.reason and str(MAX_BACKENDS) in err.reason
        assert str(count) in err.reason
    assert '"concat": ["172.18.0.10", "tcp", 81]' not in json.dumps(commands)
    # The incremental state agrees, built whole or object by object.
    state = DesiredState(GW, MAX_BACKENDS)
    state.rebuild(ListCatalog(objects[: len(objects) // 2]))
    state.update(ListCatalog(objects), [(o["kind"], o["metadata"]["name"]) for o in objects[len(objects) // 2:]
                                        if isinstance(o, dict) and isinstance(o.get("metadata"), dict)])
    assert state.services == desired.services
    assert sorted(e.key() for e in state.errors) == sorted(e.key() for e in (*inventory.errors, *desired.errors))


# ---------------------------------------------------------------- incremental consistency

def source_key(obj: Any) -> tuple[str, str] | None:
    """(kind, name) as a source reports a changed object (DirectorySource: any string kind
    and name; the Kubernetes source: the object's kind and name)."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    kind = obj.get("kind") if isinstance(obj, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return (kind, name) if isinstance(kind, str) and isinstance(name, str) else None


SLOTS = 6  # a small store: names collide, objects replace each other
store_names = st.sampled_from(["web-a", "web-b", "", "Web-A", GOOD_RULE_NAME]) | names
store_objects = st.one_of(
    rule_objects(name=store_names), rule_objects(name=st.sampled_from(["web-a", "web-b", "web-c"])),
    eip_objects(name=st.sampled_from(["eip-web", "eip-b", ""])), eip_objects(),
    st.sampled_from([eip("eip-web", "172.18.0.10"), eip("eip-b", "172.18.0.20"),
                     rule("web-a", 80, "10.0.1.11"), rule("web-b", 80, "10.0.1.12", eip_name="eip-b")]),
)
edits = st.lists(st.one_of(st.tuples(st.just("put"), st.integers(0, SLOTS - 1), store_objects),
                           st.tuples(st.just("delete"), st.integers(0, SLOTS - 1))), min_size=1, max_size=25)


def _state_view(state: DesiredState) -> tuple[Any, ...]:
    return (state.services, sorted(e.key() for e in state.errors), state.notes, state.backends)


@hsettings(max_examples=300, **HYPO)
@given(edits)
# Found by the search (shrunk): objects named "" are skipped by rebuild, taken by update.
@example([("put", 0, eip("eip-web", "172.18.0.10")), ("put", 1, rule("", 80, "10.0.1.11"))])
@example([("put", 0, eip("", "172.18.0.11")), ("put", 1, rule("sneaky", 81, "10.0.1.12", eip_name=""))])
# Found in CI: two copies of one rule name pointing at different EIPs; the second EIP
# appearing must re-evaluate the name.
@example([("put", 1, rule("web-b", 80, "10.0.1.12")), ("put", 2, rule("web-b", 80, "10.0.1.12", eip_name="eip-b")),
          ("put", 3, eip("eip-b", "172.18.0.20"))])
def test_update_after_each_hostile_edit_equals_rebuild(history: list[tuple[Any, ...]]) -> None:
    store: dict[int, Any] = {}
    state = DesiredState(GW, MAX_BACKENDS)
    state.rebuild(ListCatalog([]))
    for step, edit in enumerate(history):
        slot = edit[1]
        old = store.pop(slot, None)
        if edit[0] == "put":
            store[slot] = edit[2]
        changed = {k for k in (source_key(old), source_key(store.get(slot))) if k is not None}
        catalog = ListCatalog([store[s] for s in sorted(store)])
        before = dict(state.services)
        dirty = state.update(catalog, changed)
        fresh = DesiredState(GW, MAX_BACKENDS)
        fresh.rebuild(ListCatalog(catalog.objects()))
        note(f"step {step}: {edit[0]} slot {slot} changed={changed}")
        check_errors(state.errors)
        assert _state_view(state) == _state_view(fresh), f"step {step}"
        for identity in set(before) | set(state.services):
            if before.get(identity) != state.services.get(identity):
                assert identity in dirty, identity  # else a partial sync would not render it


@hsettings(max_examples=150, **HYPO)
@given(edits)
def test_every_batch_the_reconciler_sends_is_clean(history: list[tuple[Any, ...]]) -> None:
    """The agent's own path (whole first sync, then partial syncs of the changed objects):
    every transaction it would send is walked like the rendered plan."""
    store: dict[int, Any] = {}
    backend = Accepting()
    reconciler = Reconciler(SETTINGS, Nft("ip", "natgw", backend))
    reconciler.sync(ListCatalog([]), None)
    for edit in history:
        slot = edit[1]
        old = store.pop(slot, None)
        if edit[0] == "put":
            store[slot] = edit[2]
        changed = {k for k in (source_key(old), source_key(store.get(slot))) if k is not None}
        reconciler.sync(ListCatalog([store[s] for s in sorted(store)]), changed)
        accepted = {r for s in reconciler.state.services.values() for r in s.rule_names}
        for batch in backend.batches:  # deletions carry keys only, additions today's names
            check_commands(batch, accepted)
        backend.batches.clear()


# ----------------------------------------------------------------------- directory source

def _sorted_scandir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the directory's listing order deterministic (name order)."""
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: sorted(real(path), key=lambda e: e.name))


HOSTILE_FILES: dict[str, bytes] = {
    "nested.yaml": b"[" * 50_000 + b"]" * 50_000,
    "nested.json": b"[" * 50_000 + b"]" * 50_000,
    "nested-map.yaml": "".join(" " * i + "a:\n" for i in range(3000)).encode(),
    "invalid-utf8.yaml": b"kind: IptablesDnatRule\nmetadata: {name: caf\xe9}\n",
    "binary.yaml": bytes(random.Random(7).randrange(256) for _ in range(65536)),
    "nan.json": b'{"kind": "IptablesDnatRule", "metadata": {"name": "nan-port"}, "spec": {"eip": "eip-web", '
                b'"type": "share", "protocol": "tcp", "externalPort": NaN, "internalIp": "10.0.1.11", '
                b'"internalPort": Infinity}}',
    "junk-list.yaml": yaml.safe_dump({"kind": "List", "items": [1, "x", None, [1, 2], {"kind": 5}, {"metadata": "x"},
                                                                {"kind": RULE_KIND}, {"kind": RULE_KIND, "metadata": {"name": 7}}]}).encode(),
    "python-tag.yaml": b"!!python/object/apply:os.system ['echo pwned']\n",
    "huge-int.yaml": b"kind: IptablesDnatRule\nmetadata: {name: huge}\nspec: {externalPort: " + b"9" * 5000 + b"}\n",
}


@pytest.mark.parametrize("name", list(HOSTILE_FILES))
def test_directory_source_poll_never_raises_on_a_hostile_file(tmp_path: Path, name: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid file loaded in the same poll as a hostile one must not lose its change: the
    loop syncs only when poll() returns True."""
    _sorted_scandir(monkeypatch)
    valid = [eip("eip-web", "172.18.0.10"), rule("web-a", 80, "10.0.1.11")]
    (tmp_path / "a-valid.yaml").write_text("---\n".join(yaml.safe_dump(d) for d in valid))
    (tmp_path / f"z-{name}").write_bytes(HOSTILE_FILES[name])
    source = DirectorySource(tmp_path)
    changed, raised = False, []
    for _ in range(3):  # as run_loop does: `pending |= source.poll()`, an exception logged and skipped
        try:
            changed |= source.poll()
        except Exception as exc:
            raised.append(f"{type(exc).__name__}: {str(exc)[:80]}")
    assert source.objects()[: len(valid)] == valid
    assert changed, f"the valid file was loaded but its change never signalled (poll raised {raised})"
    assert raised == [], "an unparseable file must be logged as such, not raise out of poll()"
    assert {(r.name, r.backend.ip) for r in build_inventory(source.objects(), GW).rules} == {("web-a", "10.0.1.11")}
