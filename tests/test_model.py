"""build_inventory: Kubernetes-shaped objects in, this gateway's validated share rules out.

Pure tests, no root: each invalid field is rejected on its own rule with a precise RuleError,
objects that are not ours vanish silently, and no input shape makes it raise."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from agent.errors import RuleError
from agent.core.model import Backend, Identity, Rule
from tests.oracles import Inventory, build_inventory

GW = "gw1"
EIP_ADDR = "172.18.0.10"
MISSING = object()  # a spec value of MISSING removes the key


def make_eip(name: str = "eip-web", *, gateway: Any = GW, ip: Any = EIP_ADDR, v4ip: Any = EIP_ADDR,
             deleting: bool = False) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "kubeovn.io/v1",
        "kind": "IptablesEIP",
        "metadata": {"name": name},
        "spec": {"v4ip": v4ip, "natGwDp": gateway, "externalSubnet": "ovn-vpc-external-network"},
        "status": {"ready": True, "ip": ip},
    }
    if v4ip is MISSING:
        del obj["spec"]["v4ip"]
    if ip is MISSING:
        del obj["status"]["ip"]
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2024-05-01T10:00:00Z"
    return obj


def make_rule(name: Any = "web-80-a", *, deleting: bool = False, **spec: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "eip": "eip-web",
        "externalPort": "80",
        "protocol": "tcp",
        "internalIp": "10.0.1.11",
        "internalPort": "8080",
        "type": "share",
    }
    fields.update(spec)
    obj: dict[str, Any] = {
        "apiVersion": "kubeovn.io/v1",
        "kind": "IptablesDnatRule",
        "metadata": {"name": name, "labels": {"ovn.kubernetes.io/vpc-nat-gw-name": GW}},
        "spec": {k: v for k, v in fields.items() if v is not MISSING},
        "status": {"ready": True, "v4ip": EIP_ADDR, "natGwDp": GW},
    }
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2024-05-01T10:00:00Z"
    return obj


def good_sibling() -> dict[str, Any]:
    return make_rule("good", externalPort="443", internalIp="10.0.1.12", internalPort="9090")


GOOD_SIBLING_RULE = Rule(
    name="good",
    identity=Identity(EIP_ADDR, 443, "tcp"),
    backend=Backend("10.0.1.12", 9090),
    affinity=False,
    timeout=10800,
    eip="eip-web",
)


def only_rule(**spec: Any) -> Rule:
    """The single rule built from one valid rule with the given spec overrides."""
    inv = build_inventory([make_eip(), make_rule("r", **spec)], GW)
    assert inv.errors == ()
    assert len(inv.rules) == 1
    return inv.rules[0]


# --------------------------------------------------------------------------- invalid fields

def _bad(field: str, value: Any, *, needle: str | None = None, case: str) -> Any:
    """A spec field set to a bad value; the reason must contain `needle` (default: repr(value))."""
    key = field.removeprefix("spec.")
    return pytest.param(key, value, f"spec.{key}", repr(value) if needle is None else needle, id=case)


BAD_SPEC_VALUES = [
    # externalPort: a decimal string (or int) in 1..65535, nothing else
    _bad("externalPort", "0", case="externalPort-zero"),
    _bad("externalPort", "65536", case="externalPort-65536"),
    _bad("externalPort", "-1", case="externalPort-negative"),
    _bad("externalPort", "+80", case="externalPort-plus-sign"),
    _bad("externalPort", "80a", case="externalPort-trailing-letter"),
    _bad("externalPort", " 80", case="externalPort-leading-space"),
    _bad("externalPort", "0x50", case="externalPort-hex"),
    _bad("externalPort", "99999999", case="externalPort-too-many-digits"),
    _bad("externalPort", "", case="externalPort-empty"),
    _bad("externalPort", None, case="externalPort-null"),
    _bad("externalPort", MISSING, needle="None", case="externalPort-missing"),
    _bad("externalPort", 0, case="externalPort-int-zero"),
    _bad("externalPort", 65536, case="externalPort-int-65536"),
    _bad("externalPort", -80, case="externalPort-int-negative"),
    _bad("externalPort", 80.0, case="externalPort-float"),
    _bad("externalPort", True, case="externalPort-bool"),
    _bad("externalPort", "８０", case="externalPort-fullwidth-digits"),
    _bad("externalPort", "٨٠", case="externalPort-arabic-indic-digits"),
    _bad("externalPort", ["80"], case="externalPort-list"),
    _bad("externalPort", {"port": 80}, case="externalPort-dict"),
    _bad("externalPort", "80\n", case="externalPort-trailing-newline"),
    # internalPort: same rules
    _bad("internalPort", "0", case="internalPort-zero"),
    _bad("internalPort", "65536", case="internalPort-65536"),
    _bad("internalPort", "http", case="internalPort-name"),
    _bad("internalPort", "", case="internalPort-empty"),
    _bad("internalPort", None, case="internalPort-null"),
    _bad("internalPort", 8080.0, case="internalPort-float"),
    _bad("internalPort", False, case="internalPort-bool"),
    # protocol: tcp or udp in any case, nothing around it
    _bad("protocol", "sctp", case="protocol-sctp"),
    _bad("protocol", "", case="protocol-empty"),
    _bad("protocol", None, case="protocol-null"),
    _bad("protocol", MISSING, needle="None", case="protocol-missing"),
    _bad("protocol", "tcp ", case="protocol-trailing-space"),
    _bad("protocol", "tcp\n", case="protocol-trailing-newline"),
    _bad("protocol", "tcp/udp", case="protocol-both"),
    _bad("protocol", 6, case="protocol-number"),
    _bad("protocol", ["tcp"], case="protocol-list"),
    # internalIp: a dotted-quad IPv4 unicast address
    _bad("internalIp", "10.0.1", case="internalIp-three-octets"),
    _bad("internalIp", "010.0.1.1", case="internalIp-leading-zero"),
    _bad("internalIp", "10.0.1.256", case="internalIp-octet-256"),
    _bad("internalIp", "::1", case="internalIp-ipv6"),
    _bad("internalIp", "10.0.1.1/32", case="internalIp-cidr"),
    _bad("internalIp", "10.0.1.1; flush ruleset", case="internalIp-injection"),
    _bad("internalIp", " 10.0.1.1", case="internalIp-leading-space"),
    _bad("internalIp", "10.0.1.1\n", case="internalIp-trailing-newline"),
    _bad("internalIp", "224.0.0.1", needle="224.0.0.1", case="internalIp-multicast"),
    _bad("internalIp", "127.0.0.1", needle="127.0.0.1", case="internalIp-loopback"),
    _bad("internalIp", "0.0.0.0", needle="0.0.0.0", case="internalIp-unspecified"),
    _bad("internalIp", "255.255.255.255", needle="255.255.255.255", case="internalIp-broadcast"),
    _bad("internalIp", "", case="internalIp-empty"),
    _bad("internalIp", None, case="internalIp-null"),
    _bad("internalIp", 5, case="internalIp-int"),
    _bad("internalIp", 167772427, case="internalIp-int-address"),
    _bad("internalIp", {"ip": "10.0.1.1"}, case="internalIp-dict"),
    # sessionAffinity: "" / absent / "ClientIP" only (case-sensitive, as in Kubernetes)
    _bad("sessionAffinity", "clientip", case="sessionAffinity-lowercase"),
    _bad("sessionAffinity", "CLIENTIP", case="sessionAffinity-uppercase"),
    _bad("sessionAffinity", "None", case="sessionAffinity-None-string"),
    _bad("sessionAffinity", "ClientIP ", case="sessionAffinity-trailing-space"),
    _bad("sessionAffinity", True, case="sessionAffinity-bool"),
    _bad("sessionAffinity", 0, case="sessionAffinity-zero"),
    _bad("sessionAffinity", ["ClientIP"], case="sessionAffinity-list"),
    # sessionAffinityTimeoutSeconds: an int in 0..86400
    _bad("sessionAffinityTimeoutSeconds", -1, case="timeout-negative"),
    _bad("sessionAffinityTimeoutSeconds", 86401, case="timeout-86401"),
    _bad("sessionAffinityTimeoutSeconds", "600", case="timeout-string"),
    _bad("sessionAffinityTimeoutSeconds", 600.0, case="timeout-float"),
    _bad("sessionAffinityTimeoutSeconds", True, case="timeout-bool"),
    _bad("sessionAffinityTimeoutSeconds", {"seconds": 600}, case="timeout-dict"),
]


def _assert_single_error(inv: Inventory, name: str, field: str) -> RuleError:
    assert [r.name for r in inv.rules] == ["good"], "the valid sibling must still come out"
    assert inv.rules[0] == GOOD_SIBLING_RULE
    assert len(inv.errors) == 1, inv.errors
    err = inv.errors[0]
    assert isinstance(err, RuleError)
    assert (err.kind, err.name, err.field) == ("IptablesDnatRule", name, field)
    return err


@pytest.mark.parametrize("key, value, field, needle", BAD_SPEC_VALUES)
def test_invalid_spec_field_rejects_only_that_rule(key: str, value: Any, field: str, needle: str) -> None:
    affinity = {"sessionAffinity": "ClientIP"} if key == "sessionAffinityTimeoutSeconds" else {}
    bad = make_rule("bad", **{**affinity, key: value})
    for objects in ([make_eip(), bad, good_sibling()], [good_sibling(), bad, make_eip()]):
        err = _assert_single_error(build_inventory(objects, GW), "bad", field)
        assert needle in err.reason, f"{needle!r} not in reason {err.reason!r}"


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("Bad_Name", id="uppercase-and-underscore"),
        pytest.param("WEB", id="uppercase"),
        pytest.param("x;y", id="semicolon"),
        pytest.param("web 80", id="space"),
        pytest.param("web/80", id="slash"),
        pytest.param("-web", id="leading-dash"),
        pytest.param("web-", id="trailing-dash"),
        pytest.param("web.", id="trailing-dot"),
        pytest.param("web..80", id="empty-label"),
        pytest.param("a" * 254, id="254-chars"),
        pytest.param('web" comment "x', id="quotes"),
        pytest.param("web\n", id="trailing-newline"),
        pytest.param("web\nflush ruleset", id="embedded-newline"),
    ],
)
def test_invalid_metadata_name_rejects_only_that_rule(name: str) -> None:
    objects = [make_eip(), make_rule(name), good_sibling()]
    err = _assert_single_error(build_inventory(objects, GW), name, "metadata.name")
    # The offending value is the object's name, which RuleError carries (and shows as repr).
    assert repr(name) in str(err)
    assert "DNS-1123" in err.reason


def test_longest_valid_name_is_accepted() -> None:
    name = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
    assert len(name) == 253
    inv = build_inventory([make_eip(), make_rule(name)], GW)
    assert inv.errors == ()
    assert [r.name for r in inv.rules] == [name]


@pytest.mark.parametrize(
    "eip_kwargs, eip_field, needle",
    [
        pytest.param({"ip": "bad"}, "status.ip", "'bad'", id="status-ip-not-an-address"),
        pytest.param({"ip": "224.0.0.1"}, "status.ip", "224.0.0.1", id="status-ip-multicast"),
        pytest.param({"ip": "fd00::1"}, "status.ip", "'fd00::1'", id="status-ip-ipv6"),
        pytest.param({"ip": ["172.18.0.10"]}, "status.ip", "['172.18.0.10']", id="status-ip-list"),
        pytest.param({"ip": "", "v4ip": "bad"}, "spec.v4ip", "'bad'", id="spec-v4ip-not-an-address"),
        pytest.param({"ip": MISSING, "v4ip": "0.0.0.0"}, "spec.v4ip", "0.0.0.0", id="spec-v4ip-unspecified"),
        pytest.param({"ip": MISSING, "v4ip": MISSING}, "spec.v4ip", "None", id="no-address-at-all"),
    ],
)
def test_invalid_eip_address_is_reported_on_the_rule(eip_kwargs: dict[str, Any], eip_field: str, needle: str) -> None:
    objects = [make_eip(), make_eip("eip-bad", **eip_kwargs), make_rule("bad", eip="eip-bad"), good_sibling()]
    err = _assert_single_error(build_inventory(objects, GW), "bad", "spec.eip")
    assert "eip-bad" in err.reason
    assert eip_field in err.reason
    assert needle in err.reason


def test_every_bad_rule_is_reported_together_and_good_ones_survive() -> None:
    bad_rules = [make_rule(f"bad-{i}", **{p.values[0]: p.values[1]}) for i, p in enumerate(BAD_SPEC_VALUES)]
    goods = [make_rule(f"good-{i}", internalIp=f"10.0.2.{i + 1}") for i in range(3)]
    inv = build_inventory([goods[0], *bad_rules, goods[1], make_eip(), goods[2]], GW)
    accepted_bad = [BAD_SPEC_VALUES[int(r.name[4:])].id for r in inv.rules if r.name.startswith("bad-")]
    assert accepted_bad == [], "bad values accepted"
    assert sorted(r.name for r in inv.rules) == ["good-0", "good-1", "good-2"]
    assert sorted(e.name for e in inv.errors) == sorted(r["metadata"]["name"] for r in bad_rules)


def test_first_bad_field_is_the_one_reported() -> None:
    # One error per rule, even with several bad fields: the rule is out either way.
    inv = build_inventory([make_eip(), make_rule("bad", protocol="sctp", externalPort="0", internalIp="x")], GW)
    assert inv.rules == ()
    assert len(inv.errors) == 1
    assert inv.errors[0].field == "spec.protocol"


def test_error_message_names_kind_object_field_and_reason() -> None:
    inv = build_inventory([make_eip(), make_rule("bad", externalPort="0")], GW)
    (err,) = inv.errors
    assert str(err) == "IptablesDnatRule 'bad': spec.externalPort: '0' is not a port in 1..65535"
    assert err.key() == ("IptablesDnatRule", "bad", "spec.externalPort", "'0' is not a port in 1..65535", "")


def test_error_carries_the_objects_uid_and_version_for_events() -> None:
    bad = make_rule("bad", externalPort="0")
    bad["metadata"].update(uid="u-1", resourceVersion="42")
    (err,) = build_inventory([make_eip(), bad], GW).errors
    assert (err.uid, err.version) == ("u-1", "42")
    assert err.key()[-1] == "42"  # a new version of the object is a new change, reported anew


# --------------------------------------------------------------------------- valid rules

def test_valid_rule_is_fully_parsed() -> None:
    inv = build_inventory([make_eip(), make_rule()], GW)
    assert inv == Inventory(
        rules=(Rule("web-80-a", Identity(EIP_ADDR, 80, "tcp"), Backend("10.0.1.11", 8080), False, 10800, "eip-web"),),
        errors=(),
    )


@pytest.mark.parametrize(
    "given, expected",
    [("tcp", "tcp"), ("TCP", "tcp"), ("Tcp", "tcp"), ("udp", "udp"), ("UDP", "udp"), ("uDp", "udp")],
)
def test_protocol_is_lowercased_in_the_identity(given: str, expected: str) -> None:
    assert only_rule(protocol=given).identity.proto == expected


@pytest.mark.parametrize(
    "given, expected",
    [("80", 80), (80, 80), ("1", 1), (1, 1), ("65535", 65535), (65535, 65535)],
    ids=["str", "int", "str-min", "int-min", "str-max", "int-max"],
)
def test_ports_as_int_or_decimal_string(given: Any, expected: int) -> None:
    rule = only_rule(externalPort=given, internalPort=given)
    assert rule.identity.port == expected
    assert rule.backend.port == expected


@pytest.mark.parametrize(
    "spec, affinity, timeout",
    [
        pytest.param({}, False, 10800, id="no-affinity-fields"),
        pytest.param({"sessionAffinity": ""}, False, 10800, id="empty-affinity"),
        pytest.param({"sessionAffinity": None}, False, 10800, id="null-affinity-is-absent"),
        pytest.param({"sessionAffinity": "ClientIP"}, True, 10800, id="clientip-timeout-absent"),
        pytest.param({"sessionAffinity": "ClientIP", "sessionAffinityTimeoutSeconds": 0}, True, 10800,
                     id="clientip-timeout-zero"),
        pytest.param({"sessionAffinity": "ClientIP", "sessionAffinityTimeoutSeconds": None}, True, 10800,
                     id="clientip-timeout-null-is-absent"),
        pytest.param({"sessionAffinity": "ClientIP", "sessionAffinityTimeoutSeconds": 600}, True, 600,
                     id="clientip-600"),
        pytest.param({"sessionAffinity": "ClientIP", "sessionAffinityTimeoutSeconds": 1}, True, 1, id="clientip-1"),
        pytest.param({"sessionAffinity": "ClientIP", "sessionAffinityTimeoutSeconds": 86400}, True, 86400,
                     id="clientip-max"),
    ],
)
def test_session_affinity_and_timeout(spec: dict[str, Any], affinity: bool, timeout: int) -> None:
    rule = only_rule(**spec)
    assert rule.affinity is affinity
    assert rule.timeout == timeout


def test_eip_status_ip_is_preferred_over_spec_v4ip() -> None:
    inv = build_inventory([make_eip(ip="172.18.0.20", v4ip="172.18.0.10"), make_rule()], GW)
    assert [r.identity.eip for r in inv.rules] == ["172.18.0.20"]


@pytest.mark.parametrize(
    "eip",
    [
        pytest.param(make_eip(ip=MISSING, v4ip="172.18.0.30"), id="status-without-ip"),
        pytest.param(make_eip(ip="", v4ip="172.18.0.30"), id="status-ip-empty"),
        pytest.param(make_eip(ip=None, v4ip="172.18.0.30"), id="status-ip-null"),
        pytest.param({**make_eip(v4ip="172.18.0.30"), "status": {}}, id="empty-status"),
        pytest.param({k: v for k, v in make_eip(v4ip="172.18.0.30").items() if k != "status"}, id="no-status"),
    ],
)
def test_eip_spec_v4ip_is_used_when_status_has_no_ip(eip: dict[str, Any]) -> None:
    inv = build_inventory([eip, make_rule()], GW)
    assert inv.errors == ()
    assert [r.identity.eip for r in inv.rules] == ["172.18.0.30"]


def test_several_eips_resolve_independently() -> None:
    objects = [make_eip("eip-a", ip="172.18.0.10"), make_eip("eip-b", ip="172.18.0.20"),
               make_rule("a", eip="eip-a"), make_rule("b", eip="eip-b")]
    inv = build_inventory(objects, GW)
    assert {r.name: r.identity.eip for r in inv.rules} == {"a": "172.18.0.10", "b": "172.18.0.20"}


def test_object_order_does_not_matter() -> None:
    objects = [make_rule("a"), make_rule("b", internalIp="10.0.1.12"), make_eip(), make_rule("c", externalPort="0")]
    forward = build_inventory(objects, GW)
    backward = build_inventory(list(reversed(objects)), GW)
    assert sorted(forward.rules, key=lambda r: r.name) == sorted(backward.rules, key=lambda r: r.name)
    assert [e.key() for e in forward.errors] == [e.key() for e in backward.errors]


def test_input_objects_are_not_modified() -> None:
    objects = [make_eip(), make_rule(protocol="TCP"), make_rule("bad", externalPort="0")]
    before = copy.deepcopy(objects)
    build_inventory(objects, GW)
    assert objects == before


def test_accepts_any_iterable() -> None:
    inv = build_inventory(iter([make_eip(), make_rule()]), GW)
    assert [r.name for r in inv.rules] == ["web-80-a"]


# --------------------------------------------------------------------------- not ours: silently left out

def _without(obj: dict[str, Any], *path: str) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    node = obj
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return obj


NOT_OURS = [
    pytest.param([make_eip(), make_rule(type="exclusive")], id="exclusive-type"),
    pytest.param([make_eip(), make_rule(type=MISSING)], id="missing-type"),
    pytest.param([make_eip(), make_rule(type="Share")], id="type-wrong-case"),
    pytest.param([make_eip(), make_rule(type="")], id="empty-type"),
    pytest.param([make_eip(gateway="gw2"), make_rule()], id="eip-of-another-gateway"),
    pytest.param([make_eip(gateway=MISSING), make_rule()], id="eip-without-gateway"),
    pytest.param([make_eip(gateway="GW1"), make_rule()], id="eip-gateway-wrong-case"),
    pytest.param([make_rule()], id="missing-eip-object"),
    pytest.param([make_eip(), make_rule(eip="eip-elsewhere")], id="eip-name-not-found"),
    pytest.param([make_eip(), make_rule(eip=MISSING)], id="rule-without-eip"),
    pytest.param([make_eip(), make_rule(eip=["eip-web"])], id="rule-eip-is-a-list"),
    pytest.param([make_eip(), make_rule(deleting=True)], id="rule-being-deleted"),
    pytest.param([make_eip(deleting=True), make_rule()], id="eip-being-deleted"),
    pytest.param([make_eip(), {**make_rule(), "kind": "IptablesFIPRule"}], id="other-kind"),
    pytest.param([make_eip(), {**make_rule(), "kind": "iptablesdnatrule"}], id="kind-wrong-case"),
    pytest.param([make_eip(), _without(make_rule(), "kind")], id="rule-without-kind"),
    pytest.param([{**make_eip(), "kind": "OvnEip"}, make_rule()], id="eip-of-other-kind"),
    pytest.param([make_eip(), None, 5, "x", [], (), 3.5, b"bytes"], id="non-dict-junk"),
    pytest.param([make_eip(), {**make_rule(), "spec": [make_rule()["spec"]]}], id="rule-spec-is-a-list"),
    pytest.param([make_eip(), {**make_rule(), "spec": None}], id="rule-spec-is-null"),
    pytest.param([make_eip(), _without(make_rule(), "spec")], id="rule-without-spec"),
    # What is not ours is not validated either: no errors for other gateways' broken rules.
    pytest.param([make_eip(gateway="gw2"), make_rule("Bad_Name", externalPort="0")], id="bad-rule-of-another-gateway"),
    pytest.param([make_eip(), make_rule("Bad_Name", type="exclusive", protocol="sctp")], id="bad-exclusive-rule"),
    pytest.param([make_eip(gateway="gw2", ip="bad"), make_rule()], id="bad-eip-of-another-gateway"),
    pytest.param([make_eip(deleting=True), make_rule("x;y")], id="bad-rule-on-deleted-eip"),
    pytest.param([make_eip(), make_rule("x;y", deleting=True, externalPort="0")], id="bad-rule-being-deleted"),
    pytest.param([], id="nothing"),
]


@pytest.mark.parametrize("objects", NOT_OURS)
def test_objects_not_ours_give_neither_rules_nor_errors(objects: list[Any]) -> None:
    assert build_inventory(objects, GW) == Inventory(rules=(), errors=())


def test_not_ours_objects_do_not_hide_ours() -> None:
    junk = [
        None, 5, "x", [],
        make_rule("excl", type="exclusive"),
        make_rule("no-type", type=MISSING),
        make_rule("deleting", deleting=True),
        {**make_rule("fip"), "kind": "IptablesFIPRule"},
        {**make_rule("spec-list"), "spec": ["share"]},
        make_eip("eip-gw2", gateway="gw2"), make_rule("other-gw", eip="eip-gw2", externalPort="0"),
        make_eip("eip-gone", deleting=True), make_rule("on-deleted-eip", eip="eip-gone"),
        make_rule("unresolved", eip="eip-nowhere"),
    ]
    inv = build_inventory([*junk, make_eip(), good_sibling()], GW)
    assert inv.rules == (GOOD_SIBLING_RULE,)
    assert inv.errors == ()


# --------------------------------------------------------------------------- hostile shapes never raise

class _Weird:
    def __repr__(self) -> str:
        return "<weird>"


def _hostile_objects() -> list[Any]:
    rule = make_rule()
    eip = make_eip()
    garbage: list[Any] = [None, 5, -1, 3.5, True, "x", "", b"x", [], ["a"], {}, {"a": {"b": []}}, _Weird(),
                          float("nan"), 10**30]
    objs: list[Any] = list(garbage)
    for value in garbage:
        objs += [
            {**rule, "kind": value},
            {**rule, "metadata": value},
            {**rule, "spec": value},
            {**rule, "metadata": {"name": value}},
            {**rule, "metadata": {"name": "x", "deletionTimestamp": value}},
            {**eip, "kind": value},
            {**eip, "metadata": value},
            {**eip, "spec": value},
            {**eip, "status": value},
            {**eip, "metadata": {"name": value}},
            {**eip, "spec": {"natGwDp": value, "v4ip": value}, "status": {"ip": value}},
            {**eip, "spec": {"natGwDp": GW, "v4ip": value}, "status": {"ip": value}},
        ]
        for key in ("eip", "externalPort", "protocol", "internalIp", "internalPort", "type",
                    "sessionAffinity", "sessionAffinityTimeoutSeconds"):
            objs.append(make_rule(f"h-{key.lower()}", **{key: value}))
    objs += [
        {"kind": "IptablesDnatRule"},
        {"kind": "IptablesEIP"},
        {"kind": "IptablesDnatRule", "metadata": {}, "spec": {}},
        {"kind": "IptablesDnatRule", "metadata": {"name": ""}, "spec": {"type": "share", "eip": "eip-web"}},
        {"kind": "IptablesDnatRule", "metadata": {"name": "n"}, "spec": {"type": "share", "eip": "eip-web"}},
        {"kind": "IptablesDnatRule", "metadata": {"name": "n"}, "spec": {"type": ["share"], "eip": {"x": 1}}},
        {"kind": "IptablesEIP", "metadata": {"name": ["eip-web"]}, "spec": {"natGwDp": GW}},
        {1: 2, (3, 4): "tuple key", None: None},
        make_rule("deep", externalPort={"a": [{"b": None}]}, internalIp=[[["10.0.1.1"]]], protocol={"tcp": "tcp"}),
    ]
    return objs


def test_hostile_shapes_never_raise() -> None:
    objects = _hostile_objects()
    for obj in objects:
        for batch in ([obj], [make_eip(), obj], [obj, make_eip(), good_sibling()]):
            inv = build_inventory(batch, GW)
            assert isinstance(inv, Inventory)
            assert all(isinstance(r, Rule) for r in inv.rules)
            assert all(isinstance(e, RuleError) and e.kind == "IptablesDnatRule" for e in inv.errors)
    # All at once, with a good EIP and rule among them: the good rule still comes out.
    # Hostile EIPs named like the good one stay out of this batch: a name defined twice is
    # ambiguous and refused on purpose (test_desired.test_an_eip_defined_twice_refuses_its_rules).
    def same_named_eip(o: Any) -> bool:
        meta = o.get("metadata") if isinstance(o, dict) else None
        return isinstance(meta, dict) and o.get("kind") == "IptablesEIP" and meta.get("name") == "eip-web"

    others = [o for o in objects if not same_named_eip(o)]
    inv = build_inventory([*others, make_eip(), good_sibling()], GW)
    assert GOOD_SIBLING_RULE in inv.rules


def test_hostile_eip_reference_resolves_nothing() -> None:
    for ref in (None, 5, ["eip-web"], {"name": "eip-web"}, "", "EIP-WEB"):
        assert build_inventory([make_eip(), make_rule(eip=ref)], GW) == Inventory()
