"""The reconciler against a fake of the nft edge that holds a table: partial syncs land
exactly where full syncs land (random edit sequences, each applied once incrementally and
once as a full sync), a change costs only its identity's commands, and the mirror stays
what the table holds."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from agent.core.desired import ListCatalog
from agent.core.plan import plan
from agent.run.reconcile import Reconciler
from tests.oracles import render
from agent.settings import Settings
from tests.builders import eip, rule
from tests.fakenft import FakeNft, edges, wired
from tests.oracles import build_inventory, desired_services, kept
from tests.sources import EIPS, Store, apply_edit

SETTINGS = Settings(gateway="gw1", conntrack=False)


edits = st.one_of(
    st.tuples(st.just("rule"), st.integers(0, 11), st.sampled_from(list(EIPS)), st.sampled_from([80, 443]),
              st.sampled_from(["tcp", "UDP"]), st.integers(1, 6), st.sampled_from(["", "ClientIP"]),
              st.sampled_from([0, 60, 600])),
    st.tuples(st.just("drop-rule"), st.integers(0, 11)),
    st.tuples(st.just("eip"), st.sampled_from(list(EIPS)), st.sampled_from(["gw1", "gw2"]),
              st.sampled_from(["172.18.0.10", "172.18.0.20", "172.18.0.30", "bad"])),
    st.tuples(st.just("drop-eip"), st.sampled_from(list(EIPS))),
)


@hsettings(max_examples=150, deadline=None)
@given(st.lists(edits, min_size=1, max_size=40), st.integers(1, 6))
def test_partial_syncs_match_full_syncs(history: list[tuple[Any, ...]], every: int) -> None:
    store = Store()
    for name, address in EIPS.items():
        store.put(eip(name, address))
    settings = Settings(gateway="gw1", conntrack=False, retire_delay=0.0)
    partial = wired(settings, *edges(FakeNft()))
    full = wired(settings, *edges(FakeNft()))
    partial.sync(store, None)
    full.sync(ListCatalog(store.objects()))
    store.take()
    for step, edit in enumerate(history, 1):
        apply_edit(store, edit)
        if step % every and step != len(history):
            continue  # several edits per sync, as when changes pile up during an apply
        partial.sync(store, store.take())
        full.sync(ListCatalog(store.objects()))
        for reconciler in (partial, full):
            reconciler.retire_chains()  # emptied chains go (retire_delay 0 here)
        assert partial.mirror == full.mirror
        assert partial.state.services == full.state.services
        assert sorted(map(str, partial.state.errors)) == sorted(map(str, full.state.errors))
        # ... and both mirrors are what their tables hold.
        assert partial.view.read() == partial.mirror and full.view.read() == full.mirror
    # The mirror is exactly what a fresh render gives for the final objects (slots kept).
    services = desired_services(build_inventory(store.given.values(), "gw1").rules, SETTINGS.max_backends).services
    assert partial.state.services == services
    fresh = render(services, partial.mirror, SETTINGS.affinity_set_size, SETTINGS.priority)
    assert plan(partial.mirror, fresh, "ip", "natgw").commands == ()


def test_one_change_among_many_touches_only_its_identity() -> None:
    store = Store()
    store.put(eip("eip-a", "172.18.0.10"))
    for i in range(300):
        for b in range(4):
            store.put(rule(f"r{i}-{b}", 1000 + i, f"10.0.{b}.{i % 250 + 1}", eip_name="eip-a"))
    backend = FakeNft()
    reconciler = wired(SETTINGS, *edges(backend))
    reconciler.sync(store, None)
    store.take()
    store.put(rule("r7-2", 1007, "10.9.9.9", eip_name="eip-a"))
    result = reconciler.sync(store, store.take())
    (batch,) = backend.batches[1:]  # one transaction ...
    assert result.commands == len(batch) == 2  # ... swapping one element: same port, new address
    assert len(backend.texts) == 1  # the backend maps were declared once, by the first sync
    assert [next(iter(c)) for c in batch] == ["delete", "add"]
    for command in batch:
        element = next(iter(command.values()))["element"]
        assert element["name"] == "backend_2"
        keys = [e[0] if isinstance(e, list) else e for e in element["elem"]]  # [key, value] on add
        assert keys == [{"concat": ["172.18.0.10", "tcp", 1007]}]
    assert reconciler.sync(store, store.take()).commands == 0  # nothing changed: nothing sent


def test_only_others_changes_to_the_agents_table_are_drift() -> None:
    """A sync that declares new backend maps sends two transactions (text, then JSON):
    both are the agent's own; another table's transaction is nobody's business; a change
    to the agent's table by someone else is repaired at once, from what was damaged."""
    store = Store()
    store.put(eip("eip-a", "172.18.0.10"))
    store.put(rule("r", 80, "10.0.1.1", eip_name="eip-a"))
    backend = FakeNft()
    reconciler = wired(SETTINGS, *edges(backend))
    reconciler.sync(store, None)
    reads = reconciler.view.reads
    assert len(backend.texts) == 1 and len(backend.batches) == 1
    assert reconciler.check_drift() is False and reconciler.view.reads == reads  # its own: not even a look
    backend.external([{"add": {"table": {"family": "ip", "name": "other"}}}])
    assert reconciler.check_drift() is False and reconciler.view.reads == reads  # another table's: nothing read
    good = backend.dump()
    backend.external([{"flush": {"chain": {"family": "ip", "table": "natgw", "name": "slot_0"}}}])
    assert reconciler.check_drift() is False  # repaired in place: no full sync needed
    assert reconciler.view.reads == reads + 1 and backend.dump() == good
    assert backend.batches[-1] == [{"add": {"rule": {"family": "ip", "table": "natgw", "chain": "slot_0",
                                                     **reconciler.mirror.rules["slot_0"][0]}}}]



def test_what_others_commit_while_a_large_sync_does_not_listen_is_read_back_and_repaired(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large transaction runs with the view deaf (the kernel then builds no
    notifications): another's commit in that window is not heard, only known of, and the
    next drift check reads the table back and repairs it."""
    monkeypatch.setattr("agent.run.reconcile.LARGE_TRANSACTION", 0)  # this one sync is large
    store = Store()
    store.put(eip("eip-a", "172.18.0.10"))
    store.put(rule("r", 80, "10.0.1.1", eip_name="eip-a"))
    backend = FakeNft()
    reconciler = wired(SETTINGS, *edges(backend))
    agents = backend.json_cmd

    def then_someone_else(doc: Any) -> Any:
        out = agents(doc)
        if "slot_0" not in str(doc):
            return out  # not yet the sync's transaction
        backend.json_cmd = agents  # once
        backend.external([{"flush": {"chain": {"family": "ip", "table": "natgw", "name": "slot_0"}}}])
        return out

    backend.json_cmd = then_someone_else  # type: ignore[method-assign]
    reconciler.sync(store, None)  # large, so deaf
    clean = FakeNft()
    wired(SETTINGS, *edges(clean)).sync(store, None)
    assert reconciler.view.deaf_windows == 1 and backend.dump() != clean.dump()
    reads = reconciler.view.reads
    assert reconciler.check_drift() is False  # repaired from a read-back of everything
    assert reconciler.view.reads == reads + 1 and backend.dump() == clean.dump()
    assert reconciler.check_drift() is False and reconciler.view.reads == reads + 1  # and quiet after


# ---- against the fake table: what only the kernel could show before, without root

FAST = Settings(gateway="gw1", conntrack=False, retire_delay=0.0)
REF = {"family": "ip", "table": "natgw"}
PINNED = ("198.51.100.7", "172.18.0.10", "tcp", 443)


def programmed(settings: Settings = FAST) -> tuple[FakeNft, Reconciler, Store]:
    from tests.builders import web_objects

    backend, store = FakeNft(), Store()
    for obj in web_objects():
        store.put(obj)
    reconciler = wired(settings, *edges(backend))
    reconciler.sync(store, None)
    store.take()
    backend.pin("natgw", "aff_0", PINNED)  # a client the data path pinned to slot 0
    return backend, reconciler, store


def test_a_restarted_agent_sends_nothing_to_an_unchanged_table() -> None:
    backend, reconciler, store = programmed()
    again = wired(FAST, *edges(backend))
    assert again.sync(store, None).commands == 0 and again.mirror == reconciler.mirror
    assert PINNED in backend.entries("natgw", "aff_0")


DRIFTS = {
    "table deleted": [{"delete": {"table": {"family": "ip", "name": "natgw"}}}],
    "chain flushed": [{"flush": {"chain": {**REF, "name": "slot_0"}}}],
    "element deleted": [{"delete": {"element": {**REF, "name": "backend_1", "elem": [{"concat": ["172.18.0.10", "tcp", 80]}]}}}],
    "element changed": [{"delete": {"element": {**REF, "name": "services", "elem": [{"concat": ["172.18.0.10", "tcp", 80]}]}}},
                        {"add": {"element": {**REF, "name": "services", "elem": [[{"concat": ["172.18.0.10", "tcp", 80]}, {"drop": None}]]}}}],
    "affinity set deleted": [{"flush": {"chain": {**REF, "name": "aff_t600_n2"}}}, {"flush": {"chain": {**REF, "name": "sticky_1_t600"}}},
                             {"delete": {"set": {**REF, "name": "aff_1"}}}],
    "rule added": [{"add": {"rule": {**REF, "chain": "lb_n3", "expr": [{"drop": None}]}}}],
    "bucket deleted": [{"delete": {"element": {**REF, "name": "chash_5", "elem": [{"concat": ["172.18.0.10", "tcp", 443]}]}}}],
    "bucket changed": [
        {"delete": {"element": {**REF, "name": "chash_7", "elem": [{"concat": ["172.18.0.10", "tcp", 443]}]}}},
        {"add": {"element": {**REF, "name": "chash_7", "elem": [[{"concat": ["172.18.0.10", "tcp", 443]}, {"drop": None}]]}}}],
    "bucket chain flushed": [{"flush": {"chain": {**REF, "name": "bucket_9"}}}],
}


@pytest.mark.parametrize("drift", list(DRIFTS))
def test_drift_is_detected_and_repaired(drift: str) -> None:
    backend, reconciler, store = programmed()
    good = backend.dump()
    backend.external(DRIFTS[drift])
    assert backend.dump() != good
    # Repaired at once: from what was damaged, or, when the table itself went (which its
    # notifications cannot place), from one read-back of the table compared with the mirror.
    assert reconciler.check_drift() is False
    reconciler.retire_chains()
    if drift == "table deleted":  # the pinned client went with it: as it was, but for that
        backend.pin("natgw", "aff_0", PINNED)
    assert backend.dump() == good  # everything as it was, the pinned client included
    assert reconciler.check_drift() is False  # and the repair is not itself taken for drift
    assert reconciler.sync(store, store.take()).commands == 0


def test_a_backend_map_redeclared_by_someone_else_is_repaired_in_place() -> None:
    backend, reconciler, store = programmed()
    good = backend.dump()
    backend.external([{"flush": {"chain": {**REF, "name": "slot_1"}}}, {"delete": {"map": {**REF, "name": "backend_1"}}}])
    backend.external("add map ip natgw backend_1 { type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service; }")
    assert reconciler.check_drift() is False  # repaired in place
    assert backend.dump() == good
    assert PINNED in backend.entries("natgw", "aff_0")  # the table (and its affinity) stayed


def test_someone_elses_table_is_not_drift() -> None:
    backend, reconciler, _ = programmed()
    reads = reconciler.view.reads
    backend.external([{"add": {"table": {"family": "ip", "name": "other"}}},
                      {"add": {"chain": {"family": "ip", "table": "other", "name": "c"}}}])
    assert reconciler.check_drift() is False and reconciler.view.reads == reads  # nothing even read
    assert ("ip", "other") in backend.tables


def test_a_settings_change_redeclares_in_one_transaction_keeping_elements_and_pins() -> None:
    backend, reconciler, store = programmed(Settings(gateway="gw1", conntrack=False))
    before = reconciler.view.read()
    changed = Settings(gateway="gw1", conntrack=False, affinity_set_size=1024, priority=-161)
    batches = len(backend.batches)
    wired(changed, *edges(backend)).sync(store, None)
    assert len(backend.batches) == batches + 1 and not backend.texts[1:]  # one JSON transaction, no text
    after = reconciler.view.read()
    assert {n: d.get("size") for n, d in after.sets.items() if n.startswith("aff_")} == {"aff_0": 1024, "aff_1": 1024}
    assert after.chains["prerouting"]["prio"] == -161
    assert after.elements == before.elements  # maps and their elements stayed
    assert PINNED not in backend.entries("natgw", "aff_0")  # a redeclared set starts empty (the kernel's way)


def test_emptied_chains_are_retired_later_and_not_while_in_use() -> None:
    backend, reconciler, store = programmed(Settings(gateway="gw1", conntrack=False, retire_delay=3600.0))
    store.drop("IptablesDnatRule", "web-c")
    reconciler.sync(store, store.take())
    table = backend.tables[("ip", "natgw")]
    assert table.chains["lb_n3"].rules == [] and "lb_n2" in table.chains  # emptied, not deleted yet
    reconciler.retire_chains()
    assert "lb_n3" in table.chains  # not due
    reconciler.settings = FAST
    reconciler.retire_chains()
    assert "lb_n3" not in backend.tables[("ip", "natgw")].chains  # deleted in a transaction of its own
    assert backend.batches[-1] == [{"delete": {"chain": {**REF, "name": n}}} for n in ("lb_n3", "slot_2")]


def test_a_chain_in_use_again_is_not_retired() -> None:
    from tests.builders import rule

    backend, reconciler, store = programmed(Settings(gateway="gw1", conntrack=False, retire_delay=3600.0))
    store.drop("IptablesDnatRule", "web-c")
    reconciler.sync(store, store.take())
    store.put(rule("web-c", 80, "10.0.1.13"))
    reconciler.sync(store, store.take())
    reconciler.settings = FAST
    reconciler.retire_chains()
    assert backend.tables[("ip", "natgw")].chains["lb_n3"].rules != []  # back in use, kept


def test_a_failed_retirement_makes_the_next_sync_read_back() -> None:
    backend, reconciler, store = programmed()
    store.drop("IptablesDnatRule", "web-c")
    reconciler.sync(store, store.take())
    backend.external([{"add": {"chain": {**REF, "name": "x"}}}, {"add": {"rule": {**REF, "chain": "x", "expr": [{"goto": {"target": "lb_n3"}}]}}}])
    reads = reconciler.view.reads
    reconciler.retire_chains()  # EBUSY: someone points at it
    assert "lb_n3" in backend.tables[("ip", "natgw")].chains
    reconciler.sync(store, store.take())
    assert reconciler.view.reads == reads + 1  # read back


objects_sets = st.lists(st.tuples(st.sampled_from([80, 443, 53]), st.sampled_from(["tcp", "UDP"]), st.integers(1, 6),
                                  st.sampled_from(["", "ClientIP"])), max_size=12)


@hsettings(max_examples=200, deadline=None)
@given(objects_sets, objects_sets)
def test_applying_a_plan_to_a_table_holding_a_leaves_it_holding_b(first: list[Any], second: list[Any]) -> None:
    from agent.core.plan import retire, stale_chains
    from tests.builders import rendered

    def objects(spec: list[Any]) -> list[dict[str, Any]]:
        return [eip("eip-web", "172.18.0.10"), *(rule(f"r{i}", port, f"10.0.1.{b}", proto=proto, affinity=aff, timeout=60)
                                                for i, (port, proto, b, aff) in enumerate(spec))]

    a = rendered(objects(first))
    b = rendered(objects(second), a)
    for version, text_maps in (("1.0.6", True), ("1.1.3", False)):
        nft, view = edges(FakeNft(version))
        nft.apply(plan(None, a, "ip", "natgw", text_maps=text_maps))
        assert view.read() == a
        nft.apply(plan(a, b, "ip", "natgw", text_maps=text_maps))
        nft.apply(retire(stale_chains(a, b), "ip", "natgw"))
        assert view.read() == b


@pytest.mark.parametrize("version", ["1.0.6", "1.1.3"])
def test_the_preview_is_what_a_full_sync_sends(version: str, web_objects: list[Any]) -> None:
    """`render` and `diff` print the Planner's preview: from empty and after a change, it
    holds exactly the commands the reconciler's next full sync sends."""
    from agent.kernel.caps import probe
    from agent.ops.report import Reporter
    from agent.run.planner import Planner

    fake = FakeNft(version)
    caps = probe(*edges(fake), "ip", "natgw")
    reconciler = wired(SETTINGS, *edges(fake), caps)
    for objects in (kept(web_objects), kept([*web_objects, rule("web-b", 81, "10.0.1.12")])):
        shown = Planner(SETTINGS, caps).preview(ListCatalog(objects), fake.view().read(), Reporter())
        reconciler.request_full_sync()
        assert reconciler.sync(ListCatalog(objects)).commands == len(shown) > 0
        assert fake.batches[-1] == list(shown.phases[-1].commands)  # its one JSON transaction (1.0.6: after the text)


def _constructed(module: str) -> set[str]:
    import ast

    from tests.builders import ROOT

    tree = ast.parse((ROOT / "agent" / "run" / f"{module}.py").read_text())
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


IO_MAKERS = {"Cleanup", "Nft", "KernelView", "Conntrack", "StatusServer", "EventRecorder"}


@pytest.mark.parametrize("module", ["reconcile", "planner"])
def test_the_reconciler_makes_no_collaborator_of_its_own(module: str) -> None:
    assert _constructed(module) & IO_MAKERS == set()  # the daemon's wiring (agent/run/daemon.py) makes them, once


def test_the_collaborator_contract_can_fail() -> None:
    assert {"Cleanup", "Nft", "KernelView"} <= _constructed("daemon")


def test_a_bucket_map_deleted_by_someone_else_is_declared_and_filled_again() -> None:
    backend, reconciler, store = programmed()
    good = backend.dump()
    backend.external([{"flush": {"chain": {**REF, "name": "bucket_0"}}}, {"delete": {"map": {**REF, "name": "chash_0"}}}])
    assert backend.dump() != good
    assert reconciler.check_drift() is False
    assert backend.dump() == good
    assert reconciler.sync(store, store.take()).commands == 0
