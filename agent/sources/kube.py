"""Kubernetes source: list, then watch, IptablesDnatRule and IptablesEIP objects through the
official client, one thread per resource, into a store the reconcile loop polls.

Correct under every watch failure, the way client-go's reflector is:
- each watch starts from its list's resourceVersion, with bookmarks, a server-side
  timeout and a client-side inactivity (read) timeout;
- a stream that ends or breaks resumes from the last resourceVersion seen;
- 410 Gone (an expired version) relists, and the store is replaced wholesale, so an
  object deleted during the gap disappears, and the agent reads the kernel back;
- while the API is unreachable the store keeps the last good objects, so nothing is
  removed from the kernel because the API is down; reconnects back off with jitter.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

import structlog

from agent.backoff import Backoff
from agent.sources.kubeapi import ApiClient, ApiException, Watch, lister
from agent.core.model import Manifest, manifest
from agent.settings import WatchSettings

log = structlog.get_logger()

RULES = "iptables-dnat-rules"
EIPS = "iptables-eips"
KINDS = {RULES: "IptablesDnatRule", EIPS: "IptablesEIP"}


class _Expired(Exception):
    """The resourceVersion we watch from is gone (410): relist."""


class KubeSource:
    def __init__(self, api: ApiClient, settings: WatchSettings | None = None) -> None:
        self._listers = {plural: lister(api, plural) for plural in (RULES, EIPS)}
        self._settings = settings or WatchSettings()
        self._lock = threading.Lock()
        self._store: dict[str, dict[str, Manifest]] = {RULES: {}, EIPS: {}}  # what the model reads
        self._listed: set[str] = set()
        self._changed = False
        self._changes: set[tuple[str, str]] | None = None  # since the last take; None: all
        self._stop = threading.Event()
        self._watches: dict[str, Watch] = {}
        self._versions: dict[str, str | None] = {}  # per resource: last resourceVersion seen
        self._watched: set[str] = set()
        self._threads = [threading.Thread(target=self._run, args=(plural,), name=f"watch-{plural}", daemon=True)
                         for plural in (RULES, EIPS)]
        self.relists = 0  # lists after the first ones (410 or failure), for tests and metrics
        self.restarts = 0  # watch streams started after the first one
        self._wake: Callable[[], None] = lambda: None
        self._first_at: float | None = None  # when the oldest change not yet polled arrived
        self.changed_at: float | None = None  # ... of the changes the last poll() reported

    # The reconcile loop's side (agent/run/loop.py's Source).

    @property
    def ready(self) -> bool:
        """Both initial lists are complete: before that, nothing may be applied."""
        with self._lock:
            return len(self._listed) == 2

    def attach(self, wake: Callable[[], None]) -> bool:
        """Call `wake` (from the watch threads) whenever the store changed."""
        self._wake = wake
        return True

    def fileno(self) -> int | None:
        return None  # the watch threads wake the loop: nothing to sleep on

    def next_poll(self) -> float | None:
        return None  # nothing to poll for: poll() only takes what the watches stored

    def poll(self) -> bool:
        with self._lock:
            changed, self._changed = self._changed, False
            self.changed_at, self._first_at = self._first_at, None
            return changed

    def _changed_now(self) -> None:
        """Under the lock: the store changed."""
        self._changed = True
        if self._first_at is None:
            self._first_at = time.time()

    def take_changes(self) -> set[tuple[str, str]] | None:
        """(kind, name) of the objects changed since the last call; None (evaluate
        everything) the first time and after a relist."""
        with self._lock:
            changes, self._changes = self._changes, set()
            return changes

    def named(self, kind: str, name: str) -> list[Manifest]:
        plural = RULES if kind == KINDS[RULES] else EIPS if kind == KINDS[EIPS] else None
        with self._lock:
            obj = self._store[plural].get(name) if plural else None
        return [obj] if obj is not None else []

    def objects(self) -> list[Manifest]:
        with self._lock:
            return [obj for plural in (EIPS, RULES) for obj in self._store[plural].values()]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 0.3) -> None:
        """Stop the watches; wait for their threads `timeout` seconds in all. A watch blocked
        reading a quiet stream (bookmarks come every minute or so) ends at its next event
        or with the process: its thread is a daemon, and the agent must stop within a
        second of SIGTERM (two threads waited 2 s each: measured 4.2 s)."""
        self._stop.set()
        for w in list(self._watches.values()):
            w.stop()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    # The watch threads.

    def _run(self, plural: str) -> None:
        backoff = Backoff(self._settings.backoff_min, self._settings.backoff_max)
        while not self._stop.is_set():
            try:
                if self._versions.get(plural) is None:
                    self._list(plural)
                if self._stop.is_set():
                    return  # stopped while listing: no watch to start (stop() could not end it)
                self._watch(plural)
                backoff.reset()
            except _Expired:
                log.info("watch expired; relisting", resource=plural, resource_version=self._versions.get(plural))
                self._versions[plural] = None
            except Exception as err:  # API down, broken stream, bad answer: never kill the thread
                delay = backoff.next()
                log.warning("watch failed; reconnecting", resource=plural, error=f"{type(err).__name__}: {err}",
                            resource_version=self._versions.get(plural), retry_in=round(delay, 2))
                if self._stop.wait(delay):
                    return

    def _list(self, plural: str) -> None:
        """List in pages of settings.list_page_size, as client-go's reflector does (500):
        a 40,000-rule list in one answer is ~60 MB of JSON held whole by the client, and
        its decoded objects several times that, at once. The pages are one consistent list
        (one resourceVersion, by their continue tokens); a token that expires mid-list
        (410) starts the list again."""
        items: dict[str, Manifest] = {}
        token: str | None = None
        timeout = (self._settings.connect_timeout, self._settings.inactivity_timeout)
        while True:
            extra = {"_continue": token} if token else {}
            try:
                answer = self._listers[plural](limit=self._settings.list_page_size, _request_timeout=timeout, **extra)
            except ApiException as err:
                if err.status == 410 and token:
                    log.info("list expired between pages; listing again", resource=plural, objects_so_far=len(items))
                    items, token = {}, None
                    continue
                raise
            for o in answer.get("items") or ():
                if (kept := _manifest(plural, o)) is not None:
                    items[kept.name] = kept
            meta = answer.get("metadata") or {}
            token = meta.get("continue")
            del answer  # the page's whole objects: free before the next one arrives
            if not token:
                break
        with self._lock:
            if plural in self._listed:
                self.relists += 1
                self._changes = None  # whatever the gap hid: evaluate everything
            self._listed.add(plural)
            if items != self._store[plural] or len(self._listed) == 2:
                self._changed_now()
            self._store[plural] = items
        self._wake()
        self._versions[plural] = str(meta["resourceVersion"])
        log.info("listed", resource=plural, objects=len(items), resource_version=self._versions[plural])

    def _watch(self, plural: str) -> None:
        """Follow one watch stream from the last resourceVersion seen, until it ends."""
        w = Watch()
        self._watches[plural] = w
        timeout = int(self._settings.server_timeout * random.uniform(1.0, 2.0))
        if plural in self._watched:
            self.restarts += 1
        self._watched.add(plural)
        try:
            stream = w.stream(
                self._listers[plural],
                resource_version=self._versions[plural], allow_watch_bookmarks=True, timeout_seconds=timeout,
                _request_timeout=(self._settings.connect_timeout, self._settings.inactivity_timeout),
            )
            for event in stream:
                if self._stop.is_set():
                    break
                self._apply(plural, event)
        except ApiException as err:
            # With timeout_seconds set, the client surfaces an ERROR event as ApiException.
            if err.status == 410:
                raise _Expired() from err
            raise
        finally:
            w.stop()
            self._watches.pop(plural, None)

    def _apply(self, plural: str, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("raw_object")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK") or not isinstance(obj, dict):
            log.warning("unknown watch event skipped", resource=plural, type=str(kind))
            return
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self._versions[plural] = str(meta["resourceVersion"])
        if kind == "BOOKMARK":
            return
        name = meta.get("name")
        kept = _manifest(plural, obj) if kind != "DELETED" else None
        with self._lock:
            if kept is None:  # deleted, or now what the model ignores (being deleted): gone
                if self._store[plural].pop(name, None) is None:
                    return
            else:
                self._store[plural][name] = kept
            self._changed_now()
            if self._changes is not None:
                self._changes.add((KINDS[plural], name))
        self._wake()


def _manifest(plural: str, obj: dict[str, Any]) -> Manifest | None:
    """What the model reads of an object (None: what it ignores). List items of custom
    resources carry their kind, but nothing downstream should depend on the server
    filling it in."""
    return manifest(obj if obj.get("kind") else {**obj, "kind": KINDS[plural]})
