"""Hostile input, shared by the test_*_hostile.py files: oracles independent of the code
under test (the stdlib `ipaddress` module for addresses, plain integer ranges for ports and
timeouts, a DNS-1123 regex for names, a full walk of the rendered JSON tree), strategies
for damaged objects, and the model -> desired -> render -> plan pipeline with every
property checked on the way. Nothing may raise, every refusal must name its object and
field, and nothing syntax-shaped (or merely invalid) may reach the JSON sent to
libnftables."""
from __future__ import annotations

import ipaddress
import json
import math
import re
from typing import Any, Iterable

from hypothesis import HealthCheck, strategies as st

from agent.core.desired import DesiredState, ListCatalog
from agent.errors import RuleError
from agent.core.layout import BACKEND_DATA, chash_bucket
from agent.core.model import EIP_KIND, RULE_KIND, Rule
from agent.core.consistent import SIZE
from agent.core.plan import document, plan
from tests.oracles import render
from agent.core.ruleset import EMPTY
from agent.settings import Settings
from tests.builders import eip, rule
from tests.oracles import build_inventory, desired_services, kept


GW = "gw1"


MAX_BACKENDS = 256


SET_SIZE = 262144


PRIORITY = -160


SETTINGS = Settings(gateway=GW, conntrack=False)


HYPO = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


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
                if (bucket := chash_bucket(name)) is not None:  # a bucket's map: the sticky chain of a slot
                    assert bucket < SIZE and re.fullmatch(r"sticky_[0-9]+_t[0-9]+", value["goto"]["target"]), value
                elif name.startswith("backend_"):
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
    state.rebuild(ListCatalog(kept(objects)))
    assert state.services == desired.services
    assert sorted(e.key() for e in state.errors) == sorted(e.key() for e in (*inventory.errors, *desired.errors))
    assert state.notes == list(desired.notes)
    commands = list(plan(None, render(desired.services, EMPTY, SET_SIZE, PRIORITY), "ip", "natgw").commands)
    check_commands(commands, {r.name for r in inventory.rules})
    return inventory, desired, commands


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
