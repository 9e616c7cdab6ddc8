"""Stand-ins for a source's store: objects by (kind, name) with the change set a source
keeps, and random edits of them (used by partial-sync properties here and by the kernel
sequence script in netns-tests/scripts/)."""
from __future__ import annotations

import copy
from typing import Any

from agent.core.model import Manifest, manifest
from tests.builders import eip, rule


class Store:
    """Objects by (kind, name), like a source's store: as manifests (what the model reads),
    with the change set a source keeps; `given` holds them as put, for the oracles."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str], Manifest] = {}
        self.given: dict[tuple[str, str], dict[str, Any]] = {}
        self.changes: set[tuple[str, str]] = set()

    def put(self, obj: dict[str, Any]) -> None:
        key = (obj["kind"], obj["metadata"]["name"])
        kept = manifest(obj)
        if kept is None:  # what the model ignores is dropped, as a source drops it
            self.drop(*key)
            return
        self.items[key] = kept
        self.given[key] = obj
        self.changes.add(key)

    def drop(self, kind: str, name: str) -> None:
        self.given.pop((kind, name), None)
        if self.items.pop((kind, name), None) is not None:
            self.changes.add((kind, name))

    def objects(self) -> list[Manifest]:
        return list(self.items.values())

    def named(self, kind: str, name: str) -> list[Manifest]:
        obj = self.items.get((kind, name))
        return [obj] if obj is not None else []

    def take(self) -> set[tuple[str, str]]:
        changes, self.changes = self.changes, set()
        return changes


class StoreSource(Store):
    """The Store as a reconcile-loop source; `poll_errors` make poll() raise. It cannot wake
    the loop: the loop polls it every settings.poll_interval."""

    ready = True
    changed_at: float | None = None
    restarts = 0
    relists = 0

    def __init__(self, poll_errors: int = 0) -> None:
        super().__init__()
        self.poll_errors = poll_errors
        self.first = True

    def poll(self) -> bool:
        if self.poll_errors:
            self.poll_errors -= 1
            raise RuntimeError("injected source fault")
        return bool(self.changes)

    def take_changes(self) -> set[tuple[str, str]] | None:
        changes = self.take()
        if self.first:
            self.first = False
            return None
        return changes

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def attach(self, wake: Any) -> bool:
        return False

    def fileno(self) -> int | None:
        return None

    def next_poll(self) -> float | None:
        return None


EIPS = {"eip-a": "172.18.0.10", "eip-b": "172.18.0.20"}


def apply_edit(store: Store, edit: tuple[Any, ...]) -> None:
    """One edit: ("rule", n, eip, port, proto, backend, affinity, timeout), ("drop-rule", n),
    ("eip", name, gateway, address or "bad"), ("drop-eip", name)."""
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


class WakingSource(StoreSource):
    """A StoreSource that wakes the loop on every change, as the Kubernetes source's watch
    threads do."""

    def __init__(self) -> None:
        super().__init__()
        self.wake = lambda: None

    def attach(self, wake: Any) -> bool:
        self.wake = wake
        return True

    def put(self, obj: dict[str, Any]) -> None:
        super().put(obj)
        self.wake()
