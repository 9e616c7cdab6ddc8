"""Partial syncs must land exactly where whole syncs land: random edit sequences, each
applied once incrementally (only the changed objects named) and once as a whole sync."""
from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings as hsettings, strategies as st

from agent.desired import ListCatalog, desired_services
from agent.model import build_inventory
from agent.nft import Nft
from agent.plan import plan
from agent.reconcile import Reconciler, collect_cycles
from agent.render import render
from agent.settings import Settings
from tests.conftest import eip, rule

SETTINGS = Settings(gateway="gw1", conntrack=False)


class Accepting:
    """libnftables stand-in that takes every transaction and holds no table (no kernel
    in unit tests; the netns tests check the kernel against the same mirror)."""

    def __init__(self) -> None:
        self.batches: list[list[dict[str, Any]]] = []
        self.texts: list[str] = []  # map declarations nft.py sends as text

    def json_cmd(self, doc: dict[str, Any]) -> tuple[int, Any, str]:
        if any("list" in c for c in doc["nftables"]):
            return 1, "", "Error: No such file or directory"
        self.batches.append(doc["nftables"])
        return 0, "", ""

    def cmd(self, text: str) -> tuple[int, Any, str]:
        self.texts.append(text)
        return 0, "", ""


class Store:
    """Objects by (kind, name), like a source's store, with the change set a source keeps."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str], dict[str, Any]] = {}
        self.changes: set[tuple[str, str]] = set()

    def put(self, obj: dict[str, Any]) -> None:
        key = (obj["kind"], obj["metadata"]["name"])
        self.items[key] = obj
        self.changes.add(key)

    def drop(self, kind: str, name: str) -> None:
        if self.items.pop((kind, name), None) is not None:
            self.changes.add((kind, name))

    def objects(self) -> list[dict[str, Any]]:
        return list(self.items.values())

    def named(self, kind: str, name: str) -> list[dict[str, Any]]:
        obj = self.items.get((kind, name))
        return [obj] if obj is not None else []

    def take(self) -> set[tuple[str, str]]:
        changes, self.changes = self.changes, set()
        return changes


EIPS = {"eip-a": "172.18.0.10", "eip-b": "172.18.0.20"}
edits = st.one_of(
    st.tuples(st.just("rule"), st.integers(0, 11), st.sampled_from(list(EIPS)), st.sampled_from([80, 443]),
              st.sampled_from(["tcp", "UDP"]), st.integers(1, 6), st.sampled_from(["", "ClientIP"]),
              st.sampled_from([0, 60, 600])),
    st.tuples(st.just("drop-rule"), st.integers(0, 11)),
    st.tuples(st.just("eip"), st.sampled_from(list(EIPS)), st.sampled_from(["gw1", "gw2"]),
              st.sampled_from(["172.18.0.10", "172.18.0.20", "172.18.0.30", "bad"])),
    st.tuples(st.just("drop-eip"), st.sampled_from(list(EIPS))),
)


def apply_edit(store: Store, edit: tuple[Any, ...]) -> None:
    match edit:
        case ("rule", n, eip_name, port, proto, backend, affinity, timeout):
            store.put(rule(f"r{n}", port, f"10.0.1.{backend}", 8080 + backend % 2, proto=proto, eip_name=eip_name,
                           affinity=affinity, timeout=timeout))
        case ("drop-rule", n):
            store.drop("IptablesDnatRule", f"r{n}")
        case ("eip", name, gateway, address):
            obj = eip(name, address, gateway)
            if address == "bad":
                obj = copy.deepcopy(obj)
                obj["status"]["ip"] = "not-an-ip"
            store.put(obj)
        case ("drop-eip", name):
            store.drop("IptablesEIP", name)


@hsettings(max_examples=150, deadline=None)
@given(st.lists(edits, min_size=1, max_size=40), st.integers(1, 6))
def test_partial_syncs_match_whole_syncs(history: list[tuple[Any, ...]], every: int) -> None:
    store = Store()
    for name, address in EIPS.items():
        store.put(eip(name, address))
    partial = Reconciler(SETTINGS, Nft("ip", "natgw", Accepting()))
    whole = Reconciler(SETTINGS, Nft("ip", "natgw", Accepting()))
    partial.sync(store, None)
    whole.sync(ListCatalog(store.objects()))
    store.take()
    for step, edit in enumerate(history, 1):
        apply_edit(store, edit)
        if step % every and step != len(history):
            continue  # several edits per sync, as when changes pile up during an apply
        partial.sync(store, store.take())
        whole.sync(ListCatalog(store.objects()))
        assert partial.mirror == whole.mirror
        assert partial.state.services == whole.state.services
        assert sorted(map(str, partial.state.errors)) == sorted(map(str, whole.state.errors))
    # The mirror is exactly what a fresh render gives for the final objects (slots kept).
    services = desired_services(build_inventory(store.objects(), "gw1").rules, SETTINGS.max_backends).services
    assert partial.state.services == services
    fresh = render(services, partial.mirror, SETTINGS.affinity_set_size, SETTINGS.priority)
    assert plan(partial.mirror, fresh, "ip", "natgw") == []


def test_one_change_among_many_touches_only_its_identity() -> None:
    store = Store()
    store.put(eip("eip-a", "172.18.0.10"))
    for i in range(300):
        for b in range(4):
            store.put(rule(f"r{i}-{b}", 1000 + i, f"10.0.{b}.{i % 250 + 1}", eip_name="eip-a"))
    backend = Accepting()
    reconciler = Reconciler(SETTINGS, Nft("ip", "natgw", backend))
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


def test_a_sync_freezes_what_it_kept_and_collect_cycles_still_frees_cycles() -> None:
    import gc
    import weakref

    class Node:
        pass

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # no collection may free the cycle before the sync freezes it
    try:
        cycle = Node()
        cycle.self = cycle  # type: ignore[attr-defined]
        gone = weakref.ref(cycle)
        del cycle  # garbage only the cyclic collector can free
        store = Store()
        store.put(eip("eip-a", "172.18.0.10"))
        store.put(rule("r", 80, "10.0.1.1", eip_name="eip-a"))
        reconciler = Reconciler(SETTINGS, Nft("ip", "natgw", Accepting()))
        gc.enable()
        reconciler.sync(store, None)
        assert gc.get_freeze_count() > 0  # the sync's survivors are out of the collector's scans
        gc.collect()
        assert gone() is not None  # frozen: a normal collection does not reach it
        collect_cycles()
        assert gone() is None and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
        else:
            gc.disable()


def test_declaring_backend_maps_first_is_not_mistaken_for_drift() -> None:
    """A sync that declares new backend maps sends two transactions (text, then JSON); the
    drift check must count both as the agent's own and not read the table back."""
    store = Store()
    store.put(eip("eip-a", "172.18.0.10"))
    store.put(rule("r", 80, "10.0.1.1", eip_name="eip-a"))
    backend = Accepting()
    nft = Nft("ip", "natgw", backend)
    reconciler = Reconciler(SETTINGS, nft)
    reconciler.sync(store, None)
    assert len(backend.texts) == 1 and nft.generation() == 2
    assert reconciler.check_drift() is False  # a read-back here would find no table: "drift"
    nft.transactions += 1  # someone else's transaction moves the generation
    assert reconciler.check_drift() is True  # ... and then the table is read back
