"""Memory around syncs: the cyclic collector paused during one, its survivors frozen out
of later collections, and collect_cycles() still freeing cycles among them."""
from __future__ import annotations

from agent.memory import collect_cycles
from agent.settings import Settings
from tests.builders import eip, rule
from tests.fakenft import FakeNft, edges, wired
from tests.sources import Store

SETTINGS = Settings(gateway="gw1", conntrack=False)


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
        reconciler = wired(SETTINGS, *edges(FakeNft()))
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


