"""Hostile input to the desired state: siblings that disagree, identities over the backend
limit, and object-by-object updates that always equal a rebuild."""
from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import example, given, note, settings as hsettings, strategies as st

from agent.core.desired import DesiredState, ListCatalog
from agent.core.model import RULE_KIND, Identity
from tests.builders import eip, rule
from tests.hostile import GW, HYPO, MAX_BACKENDS, check_errors, edits, pipeline, source_key
from tests.oracles import kept

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
    # The incremental state agrees, rebuilt or updated object by object.
    state = DesiredState(GW, MAX_BACKENDS)
    state.rebuild(ListCatalog(kept(objects[: len(objects) // 2])))
    state.update(ListCatalog(kept(objects)), [(o["kind"], o["metadata"]["name"]) for o in objects[len(objects) // 2:]
                                        if isinstance(o, dict) and isinstance(o.get("metadata"), dict)])
    assert state.services == desired.services
    assert sorted(e.key() for e in state.errors) == sorted(e.key() for e in (*inventory.errors, *desired.errors))


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
    """The incremental state, fed objects as a source keeps them (manifests), always
    equals a rebuild from them all."""
    store: dict[int, Any] = {}
    state = DesiredState(GW, MAX_BACKENDS)
    state.rebuild(ListCatalog([]))
    for step, edit in enumerate(history):
        slot = edit[1]
        old = store.pop(slot, None)
        if edit[0] == "put":
            store[slot] = edit[2]
        changed = {k for k in (source_key(old), source_key(store.get(slot))) if k is not None}
        catalog = ListCatalog(kept(store[s] for s in sorted(store)))
        before = dict(state.services)
        dirty = state.update(catalog, changed)
        fresh = DesiredState(GW, MAX_BACKENDS)
        fresh.rebuild(catalog)
        note(f"step {step}: {edit[0]} slot {slot} changed={changed}")
        check_errors(state.errors)
        assert _state_view(state) == _state_view(fresh), f"step {step}"
        for identity in set(before) | set(state.services):
            if before.get(identity) != state.services.get(identity):
                assert identity in dirty, identity  # else a partial sync would not render it
