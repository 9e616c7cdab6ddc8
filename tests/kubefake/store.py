"""Objects, resourceVersions, history and watches: what etcd and the watch cache do for the API
server, in memory. One global resourceVersion counter, like etcd's revision, and every change
since the last compaction, so a list page can be read at its list's version and a watch can
replay from any version; below the compaction point both are 410 Expired."""
from __future__ import annotations

import copy
import queue
import threading
import uuid
from dataclasses import dataclass

from .protocol import JSON, RESOURCES, ApiError, ResourceType, decode_continue, encode_continue, not_found

END = "end"      # finish a watch stream cleanly, with the terminating chunk
BREAK = "break"  # drop a watch connection without it
Item = JSON | str

# The API server's words (storage/etcd3) for a continue token whose version was compacted.
INCONSISTENT_CONTINUE = (
    "The provided continue parameter is too old to display a consistent list result. You can start a "
    "new list without the continue parameter, or use the continue token in this response to retrieve "
    "the remainder of the results. Continuing with the provided token results in an inconsistent list "
    "- objects that were created, modified, or deleted between the time the first chunk was returned "
    "and now may show up in the list.")


@dataclass(frozen=True)
class Change:
    rv: int
    plural: str
    key: str
    type: str          # ADDED / MODIFIED / DELETED
    obj: JSON          # never mutated after commit
    prev: JSON | None  # the object before the change (None for ADDED): what older reads see

    def event(self) -> JSON:
        return {"type": self.type, "object": self.obj}


class Watcher:
    def __init__(self, rtype: ResourceType, bookmarks: bool) -> None:
        self.rtype = rtype
        self.bookmarks = bookmarks
        self.queue: queue.Queue[Item] = queue.Queue()
        # Its response headers are out (set by the handler): from then on a cut is a stream
        # cut short; before, a failed request, which the client's urllib3 retries.
        self.answered = False


def _key(rtype: ResourceType, name: str, namespace: str | None) -> str:
    """The object's key below its resource's prefix, as etcd orders them."""
    return f"{namespace or 'default'}/{name}" if rtype.namespaced else name


class Store:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.rv = 1  # like a fresh etcd: the first write gets "2"
        self._objects: dict[str, dict[str, JSON]] = {p: {} for p in RESOURCES}
        self._history: list[Change] = []
        self._floor = 0  # compacted: reads and watches from before this version get 410
        self._watchers: set[Watcher] = set()

    # -- writes ---------------------------------------------------------------------------------

    def create(self, rtype: ResourceType, obj: JSON, namespace: str | None, *, strict: bool) -> JSON:
        """``strict``: a request's body, whose namespace must match the path's."""
        meta = _admit(rtype, obj, namespace, strict)
        with self.lock:
            key = _key(rtype, meta["name"], meta.get("namespace"))
            if key in self._objects[rtype.plural]:
                raise ApiError(409, f'{rtype.qualified} "{meta["name"]}" already exists', "AlreadyExists",
                               details={"name": meta["name"], "group": rtype.group, "kind": rtype.plural})
            meta["uid"] = str(uuid.uuid4())
            return self._commit(rtype, "ADDED", key, obj, None)

    def update(self, rtype: ResourceType, obj: JSON, namespace: str | None) -> JSON:
        meta = _admit(rtype, obj, namespace, strict=False)
        with self.lock:
            key = _key(rtype, meta["name"], meta.get("namespace"))
            current = self._current(rtype, key, meta["name"])
            meta["uid"] = current["metadata"]["uid"]
            return self._commit(rtype, "MODIFIED", key, obj, current)

    def delete(self, rtype: ResourceType, name: str, namespace: str | None) -> JSON:
        with self.lock:
            key = _key(rtype, name, namespace)
            current = self._current(rtype, key, name)
            return self._commit(rtype, "DELETED", key, copy.deepcopy(current), current)

    def compact(self) -> None:
        """Forget the history up to now, like etcd compaction."""
        with self.lock:
            self._history.clear()
            self._floor = self.rv

    def _commit(self, rtype: ResourceType, kind: str, key: str, obj: JSON, prev: JSON | None) -> JSON:
        """Next resourceVersion, store, history, watches (locked)."""
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            del self._objects[rtype.plural][key]
        else:
            self._objects[rtype.plural][key] = obj
        change = Change(self.rv, rtype.plural, key, kind, obj, prev)
        self._history.append(change)
        for watcher in self._watchers:
            if watcher.rtype is rtype:
                watcher.queue.put(change.event())
        return copy.deepcopy(obj)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, rtype: ResourceType, name: str, namespace: str | None) -> JSON:
        with self.lock:
            return copy.deepcopy(self._current(rtype, _key(rtype, name, namespace), name))

    def objects(self, rtype: ResourceType, namespace: str | None) -> list[JSON]:
        with self.lock:
            return [copy.deepcopy(o) for _, o in sorted(self._objects[rtype.plural].items())
                    if namespace is None or o["metadata"].get("namespace") == namespace]

    def list(self, rtype: ResourceType, limit: int, token: str) -> JSON:
        """One page, as etcd3's GetList serves it: every page of a list at the first page's
        version, ``continue`` and ``remainingItemCount`` while items remain."""
        with self.lock:
            start, rv = decode_continue(token) if token else ("", self.rv)
            if rv < 0:
                rv = self.rv  # the token of a 410: go on at the latest version
            elif rv < self._floor:
                raise ApiError(410, INCONSISTENT_CONTINUE, "Expired", list_continue=encode_continue(start, -1))
            state = self._state_at(rtype.plural, rv)
            keys = sorted(k for k in state if k >= start)
            page = keys[:limit] if limit > 0 else keys
            items = [state[k] for k in page]
        meta: JSON = {"resourceVersion": str(rv)}
        if len(page) < len(keys):
            meta["continue"] = encode_continue(page[-1] + "\x00", rv)  # right after the last key
            meta["remainingItemCount"] = len(keys) - len(page)
        # The stored objects themselves, not copies: stored objects are never changed in
        # place (a change stores a new one), and the server serialises the page at once.
        # Deep copies cost 130 ms a page of 500 kube-ovn-sized objects, the fake's time,
        # not the client's.
        return {"apiVersion": rtype.api_version, "kind": rtype.kind + "List", "metadata": meta, "items": items}

    def _current(self, rtype: ResourceType, key: str, name: str) -> JSON:
        obj = self._objects[rtype.plural].get(key)
        if obj is None:
            raise not_found(rtype, name)
        return obj

    def _state_at(self, plural: str, rv: int) -> dict[str, JSON]:
        """The objects as of version ``rv``: today's, with every later change undone (locked)."""
        state = dict(self._objects[plural])
        for change in reversed(self._history):
            if change.rv <= rv:
                break
            if change.plural != plural:
                continue
            if change.prev is None:
                del state[change.key]
            else:
                state[change.key] = change.prev
        return state

    # -- watches --------------------------------------------------------------------------------

    def open_watch(self, rtype: ResourceType, start: int, bookmarks: bool) -> Watcher:
        """Replay the changes after ``start``, then follow live ones; before the compaction
        point, an ERROR 410 event and the end of the stream."""
        watcher = Watcher(rtype, bookmarks)
        with self.lock:  # replay and registration together: nothing missed or doubled
            if start < self._floor:
                expired = ApiError(410, f"too old resource version: {start} ({self._floor})", "Expired")
                watcher.queue.put({"type": "ERROR", "object": expired.status()})
                watcher.queue.put(END)
                return watcher  # never registered: this stream carries the error and ends
            for change in self._history:
                if change.plural == rtype.plural and change.rv > start:
                    watcher.queue.put(change.event())
            self._watchers.add(watcher)
        return watcher

    def close_watch(self, watcher: Watcher) -> None:
        with self.lock:
            self._watchers.discard(watcher)

    def watchers(self, plural: str | None = None) -> list[Watcher]:
        with self.lock:
            return [w for w in self._watchers if plural is None or w.rtype.plural == plural]

    def push(self, plural: str | None, item: Item) -> int:
        with self.lock:
            targets = self.watchers(plural)
            for watcher in targets:
                watcher.queue.put(item)
        return len(targets)

    def bookmark(self, watcher: Watcher) -> None:
        with self.lock:  # version read and queued together, so a bookmark never overtakes an event
            watcher.queue.put({"type": "BOOKMARK", "object": {
                "kind": watcher.rtype.kind, "apiVersion": watcher.rtype.api_version,
                "metadata": {"resourceVersion": str(self.rv)}}})


def _admit(rtype: ResourceType, obj: JSON, namespace: str | None, strict: bool) -> JSON:
    """Type, name and namespace of an object to write; returns its metadata."""
    for field, want in (("apiVersion", rtype.api_version), ("kind", rtype.kind)):
        if obj.get(field) not in (None, "", want):
            raise ApiError(400, f"{field} {obj.get(field)!r} does not match {want!r} for {rtype.plural}")
    obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
    meta = obj.setdefault("metadata", {})
    if not isinstance(meta, dict) or not meta.get("name"):
        raise ApiError(422, "metadata.name: Required value: name is required")
    if not rtype.namespaced:
        meta.pop("namespace", None)  # the API server drops it on cluster-scoped objects
    elif strict and meta.get("namespace") not in (None, "", namespace):
        raise ApiError(400, "the namespace of the provided object does not match the namespace sent on the request")
    else:
        meta["namespace"] = namespace or meta.get("namespace") or "default"
    return meta
