"""Hostile input to the model: arbitrary objects; nothing raises, refusals name their object
and field, one bad object never hides a good one, and order never matters."""
from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import example, given, settings as hsettings, strategies as st

from agent.core.model import EIP_KIND, RULE_KIND, Backend, Identity, Rule
from tests.builders import eip, rule
from tests.oracles import as_dict, build_inventory, kept
from tests.hostile import (BAD_NAMES, EIP_FIELDS, GOOD_EIP_NAME, GOOD_RULE_NAME, GW, HYPO, MISSING, RULE_FIELDS,
                           RULE_NAMES, batches, damaged, eip_objects, hostile, pipeline, rule_objects, valid_name)

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


GOOD = Rule(GOOD_RULE_NAME, Identity("172.18.0.99", 8443, "tcp"), Backend("10.0.9.9", 9443), False, 10800, GOOD_EIP_NAME)


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


@hsettings(max_examples=300, **HYPO)
@given(batches)
def test_an_object_is_judged_by_its_manifest_alone(objects: list[Any]) -> None:
    """What a source keeps (model.manifest, the one form the model takes) is all the model
    judges by: the object rebuilt from it alone gives the same rules and the same errors."""
    rebuilt = [as_dict(m) for m in kept(objects)]
    assert kept(rebuilt) == kept(objects)
    whole, kept_only = build_inventory(objects, GW), build_inventory(rebuilt, GW)
    assert kept_only.rules == whole.rules
    assert [e.key() for e in kept_only.errors] == [e.key() for e in whole.errors]
