"""Directory source: every *.yaml, *.yml and *.json file in a directory holds objects as
the Kubernetes API returns them (one object, several YAML documents, or a `kind: List`).

Once started, it follows the directory through inotify: a file closed after writing or
renamed into place is read at once; one written in place and still open is read once its
stat signature has held still for a poll interval (an editor that truncates and then
writes must not withdraw live rules for a moment). Where inotify cannot be had (or the
directory is removed), it falls back to polling by stat signature every poll interval,
the same settle rule for every changed file. A file that fails to parse keeps its last
good content; a removed file withdraws its objects."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import structlog
import yaml

from agent.sources.inotify import COMPLETE, GONE_SELF, Inotify
from agent.core.model import Manifest, manifest

log = structlog.get_logger()
SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class _Stamp:
    mtime_ns: int
    size: int
    inode: int


class DirectorySource:
    # Of the loop's Source protocol (agent/run/loop.py): no watches, no time of receipt.
    changed_at: float | None = None
    restarts = 0
    relists = 0

    def __init__(self, directory: Path, poll_interval: float = 0.2) -> None:
        self.directory = Path(directory)
        self.poll_interval = poll_interval
        self._notify: Inotify | None = None
        self._complete: set[str] = set()  # files inotify saw closed after writing, or renamed in
        self._settling = False  # a changed file waits to hold still
        self._stamps: dict[str, _Stamp] = {}  # as loaded
        self._seen: dict[str, _Stamp] | None = None  # as scanned by the previous poll
        self._objects: dict[str, list[Manifest]] = {}  # what the model reads, per file
        self._failed: dict[str, str] = {}
        self._named: dict[tuple[str, str], list[Manifest]] = {}  # (kind, name) -> objects, all files
        self._changes: set[tuple[str, str]] | None = None  # since the last take; None: all

    @property
    def ready(self) -> bool:
        """True once the directory has been read: before that, an empty object list
        means "unknown", not "no rules", and must not wipe the kernel."""
        return self._seen is not None

    def start(self) -> None:
        """Follow the directory through inotify (no thread: the loop sleeps on fileno())."""
        try:
            self._notify = Inotify(str(self.directory))
        except OSError as err:
            log.warning("no inotify on the rules directory; polling it", directory=str(self.directory),
                        every_s=self.poll_interval, error=str(err))

    def stop(self) -> None:
        if self._notify is not None:
            self._notify.close()
            self._notify = None

    def attach(self, wake: Callable[[], None]) -> bool:
        """Nothing to attach: the loop sleeps on fileno(), or polls."""
        return False

    def fileno(self) -> int | None:
        """Readable when the directory changed (None: poll it)."""
        return self._notify.fileno() if self._notify is not None else None

    def next_poll(self) -> float | None:
        """When poll() must be called again even if nothing is read: a file settling, or no
        inotify (monotonic; None: not until the descriptor says so)."""
        if self._notify is None or self._settling:
            return time.monotonic() + self.poll_interval
        return None

    def named(self, kind: str, name: str) -> list[Manifest]:
        return self._named.get((kind, name), [])

    def take_changes(self) -> set[tuple[str, str]] | None:
        """(kind, name) of the objects changed since the last call; None the first time."""
        changes, self._changes = self._changes, set()
        return changes

    def poll(self) -> bool:
        """Re-read what changed since the last poll; True if anything did."""
        if self._notify is not None:
            for event in self._notify.read():
                if event.mask & GONE_SELF:
                    log.warning("rules directory gone; polling for it", directory=str(self.directory))
                    self._notify.close()
                    self._notify = None
                    break
                if event.mask & COMPLETE:
                    self._complete.add(event.name)
        current = self._scan()
        if current is None:
            return False  # unreadable: keep serving what we had
        changed = False
        for name in set(self._stamps) - set(current):
            del self._stamps[name]
            self._replace(name, [])
            self._failed.pop(name, None)
            changed = True
        self._settling = False
        complete, self._complete = self._complete, set()
        for name, stamp in current.items():
            if self._stamps.get(name) == stamp:
                continue
            if self._seen is not None and self._seen.get(name) != stamp and name not in complete:
                self._settling = True
                continue  # still changing (or just appeared): read it on the next poll
            self._stamps[name] = stamp
            changed |= self._load(name)
        self._seen = current
        return changed

    def objects(self) -> list[Manifest]:
        return [obj for name in sorted(self._objects) for obj in self._objects[name]]

    def _scan(self) -> dict[str, _Stamp] | None:
        stamps: dict[str, _Stamp] = {}
        try:
            entries = list(os.scandir(self.directory))
        except OSError as err:
            log.error("cannot read rules directory", directory=str(self.directory), error=str(err))
            return None
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(SUFFIXES):
                continue
            try:
                st = entry.stat()
            except OSError:
                continue  # removed between scandir and stat
            if entry.is_file():
                stamps[entry.name] = _Stamp(st.st_mtime_ns, st.st_size, st.st_ino)
        return stamps

    def _load(self, name: str) -> bool:
        path = self.directory / name
        try:
            text = path.read_text(encoding="utf-8")
            docs = [json.loads(text)] if name.endswith(".json") else list(yaml.safe_load_all(text))
        except (OSError, ValueError, yaml.YAMLError, RecursionError) as err:  # RecursionError: absurd nesting
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            if self._failed.get(name) != reason:
                log.error("cannot parse rules file; keeping its last good content", file=str(path), error=reason)
            self._failed[name] = reason
            return False
        self._failed.pop(name, None)
        # Only what the model reads, as manifests: the rest (other kinds, nameless objects,
        # objects being deleted, fields the model never reads) is dropped here.
        objects = [m for doc in docs for item in _items(doc) if (m := manifest(item)) is not None]
        if self._objects.get(name) == objects:
            return False
        self._replace(name, objects)
        return True

    def _replace(self, file: str, objects: list[Manifest]) -> None:
        """Swap one file's objects, keeping the by-name index, and note only the names
        whose objects really changed: one edited rule in a file of thousands is one change."""
        old = _by_key(self._objects.pop(file, []))
        new = _by_key(objects)
        for key in old.keys() | new.keys():
            before, after = old.get(key, []), new.get(key, [])
            copies = [o for o in self._named.get(key, []) if not any(o is b for b in before)] + after
            if copies:
                self._named[key] = copies
            else:
                self._named.pop(key, None)
            if before != after:
                self._note(key)
        if objects:
            self._objects[file] = objects

    def _note(self, key: tuple[str, str]) -> None:
        if self._changes is not None:
            self._changes.add(key)


def _items(doc: Any) -> list[Any]:
    if not isinstance(doc, dict):
        return []
    kind = doc.get("kind")
    if not (isinstance(kind, str) and kind.endswith("List") and "items" in doc):
        return [doc]
    items = doc.get("items")
    # An API list (IptablesDnatRuleList) may leave kind off its items; `kind: List` keeps it.
    item_kind = kind.removesuffix("List") or None
    return [{"kind": item_kind, **i} if item_kind else i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _by_key(objects: list[Manifest]) -> dict[tuple[str, str], list[Manifest]]:
    found: dict[tuple[str, str], list[Manifest]] = {}
    for obj in objects:
        found.setdefault((obj.kind, obj.name), []).append(obj)
    return found
