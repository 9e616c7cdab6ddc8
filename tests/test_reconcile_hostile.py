"""Hostile input through the reconciler: every transaction it sends, full or partial, is
clean."""
from __future__ import annotations

from typing import Any

from hypothesis import given, settings as hsettings

from agent.core.desired import ListCatalog
from tests.fakenft import FakeNft, edges, wired
from tests.hostile import HYPO, SETTINGS, check_commands, edits, source_key
from tests.oracles import kept

@hsettings(max_examples=150, **HYPO)
@given(edits)
def test_every_batch_the_reconciler_sends_is_clean(history: list[tuple[Any, ...]]) -> None:
    """The agent's own path (full first sync, then partial syncs of the changed objects):
    every transaction it would send is walked like the rendered plan."""
    store: dict[int, Any] = {}
    backend = FakeNft()
    reconciler = wired(SETTINGS, *edges(backend))
    reconciler.sync(ListCatalog([]), None)
    for edit in history:
        slot = edit[1]
        old = store.pop(slot, None)
        if edit[0] == "put":
            store[slot] = edit[2]
        changed = {k for k in (source_key(old), source_key(store.get(slot))) if k is not None}
        reconciler.sync(ListCatalog(kept(store[s] for s in sorted(store))), changed)
        accepted = {r for s in reconciler.state.services.values() for r in s.rule_names}
        for batch in backend.batches:  # deletions carry keys only, additions today's names
            check_commands(batch, accepted)
        backend.batches.clear()
