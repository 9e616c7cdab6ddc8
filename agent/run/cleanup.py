"""Cleanup off the loop's path: what a committed change leaves behind in conntrack and
in the affinity sets, cleared in a thread of its own so that no cleanup holds up the
next change.

Why a thread: deleting flows with one `conntrack -D` per removed identity inside the sync
held another identity's change 24 s behind the removal of 2,000 identities. Here:

- conntrack is reconciled by state (agent/core/flows.py): after each change the identities it
  touched, after a full sync every UDP identity, are compared with what conntrack holds,
  over netlink (agent/kernel/ctnetlink.py), and what is stale is deleted in batches. Work that
  fails stays pending and is retried; identities that went stay on the list until a pass
  cleared them.
- affinity: the sets of the slots a change freed are read here (a netlink dump, ~40 ms
  for 10,000 entries); the deletes go back to the loop as prepared slices, because the
  agent writes through libnftables from the loop's thread only. The loop applies one
  slice (at most `cleanup_slice` entries, one transaction) per turn, after any sync.

A slot whose old clients' entries are not yet deleted is `blocked` for that identity:
rendering gives it to no new backend of the identity (agent/core/render.py), or those clients
would follow the newcomer, and the delete would take the newcomer's own fresh pins."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol, Sequence

import structlog

from agent.core.flows import Flow, Query, queries, stale
from agent.core.layout import affinity_set, key_identity
from agent.core.model import Backend, Identity
from agent.core.ruleset import ElemKey

log = structlog.get_logger()
Backends = Callable[[Identity], "Sequence[Backend] | None"]  # an identity's backends now (None: not served)
Report = Callable[[str, int, float], None]  # (kind, entries deleted, seconds)


class FlowTable(Protocol):
    """agent/kernel/ctnetlink.py's Conntrack (in unit tests, a fake)."""

    def flows(self, query: Query) -> Iterable[Flow]: ...
    def delete(self, flows: Sequence[Flow]) -> int: ...


class SetReader(Protocol):
    def entries(self, name: str) -> list[ElemKey]: ...


@dataclass(frozen=True)
class Slice:
    """Affinity entries to delete in one transaction; the last slice of a slot's job also
    unblocks that slot for its identities."""

    slot: int
    keys: tuple[ElemKey, ...]
    identities: frozenset[ElemKey]  # identity keys whose entries in this slot are stale
    last: bool

    @property
    def set_name(self) -> str:
        return affinity_set(self.slot)


class Cleanup:
    """The cleanup worker. The loop's thread calls note(), next_slice() and applied() and
    reads `blocked`; run_once() (in the thread start() makes, or called by a test) does
    the rest."""

    def __init__(self, backends: Backends, flow_table: Callable[[], FlowTable] | None,
                 set_reader: Callable[[], SetReader], slice_size: int = 2000,
                 wake: Callable[[], None] = lambda: None, report: Report = lambda kind, n, s: None,
                 retry: float = 1.0) -> None:
        self.backends = backends
        self._flow_table_factory = flow_table
        self._set_reader_factory = set_reader
        self._flow_table: FlowTable | None = None
        self._set_reader: SetReader | None = None
        self.slice_size = slice_size
        self.wake = wake
        self.report = report
        self.failed: Callable[[str], None] = lambda kind: None  # a pass that failed, by kind (metrics)
        self.retry = retry
        self._lock = threading.Condition()
        self._check: set[Identity] = set()  # identities whose flows to compare with their backends
        self._gone: set[Identity] = set()  # identities that went: all their flows go
        self._stale: dict[int, set[ElemKey]] = {}  # slot -> identity keys whose entries there are stale
        self._slices: deque[Slice] = deque()
        self._retry_at = 0.0
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.blocked: dict[Identity, set[int]] = {}  # the loop's thread only

    # --- the loop's side --------------------------------------------------------------------

    def note(self, check: Iterable[Identity], gone: Iterable[Identity],
             affinity: Mapping[int, Iterable[ElemKey]]) -> None:
        """After a committed change: identities whose flows to compare, identities that
        went, and per slot the identities whose affinity entries there are stale."""
        gone = set(gone)
        with self._lock:
            if self._flow_table_factory is not None:
                self._check.update(i for i in check if i.proto == "udp" and i not in gone)
                self._gone |= gone
                self._check -= gone
            for slot, keys in affinity.items():
                keys = set(keys)
                self._stale.setdefault(slot, set()).update(keys)
                for key in keys:
                    self.blocked.setdefault(key_identity(key), set()).add(slot)
            self._lock.notify()

    def next_slice(self) -> Slice | None:
        with self._lock:
            return self._slices.popleft() if self._slices else None

    def has_slice(self) -> bool:
        return bool(self._slices)

    def applied(self, piece: Slice, ok: bool) -> None:
        """The loop applied a slice, or could not (an entry in it expired meanwhile, which
        fails the whole delete): then what remains of its job is read again, and the slot
        stays blocked until a job's last slice lands."""
        if not ok:
            with self._lock:
                self._slices = deque(s for s in self._slices
                                     if (s.slot, s.identities) != (piece.slot, piece.identities))
                self._stale.setdefault(piece.slot, set()).update(piece.identities)
                self._lock.notify()
            return
        if piece.last:
            for key in piece.identities:
                identity = key_identity(key)
                held = self.blocked.get(identity)
                if held is not None:
                    held.discard(piece.slot)
                    if not held:
                        del self.blocked[identity]

    def pending(self) -> bool:
        with self._lock:
            return bool(self._check or self._gone or self._stale or self._slices)

    # --- the worker ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cleanup", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopped:
                    wait = self._retry_at - time.monotonic()
                    if wait > 0:  # after a failure: not before it is due
                        self._lock.wait(wait)
                        continue
                    if self._check or self._gone or self._stale:
                        break
                    self._lock.wait()  # until note() or stop(): no timer at rest
                if self._stopped:
                    return
            self.run_once()

    def run_once(self) -> None:
        """One round of whatever is pending: flows, then affinity entries. What fails stays
        pending, retried after `retry` seconds; nothing raises."""
        with self._lock:
            check, gone, stale_sets = self._check, self._gone, self._stale
            self._check, self._gone, self._stale, self._retry_at = set(), set(), {}, 0.0
        if check or gone:
            try:
                self._flows(check, gone)
            except Exception as err:  # OSError: the kernel; anything else: a bug, which must not end the cleanup
                log.warning("conntrack cleanup failed; will retry", error=f"{type(err).__name__}: {err}",
                            identities=len(check) + len(gone), exc_info=not isinstance(err, OSError))
                self.failed("conntrack")
                self._keep(check=check, gone=gone)
        if stale_sets:
            try:
                self._affinity(stale_sets)
            except Exception:
                log.exception("affinity cleanup failed; will retry")
                self.failed("affinity")
                self._keep(stale=stale_sets)

    def _keep(self, check: Iterable[Identity] = (), gone: Iterable[Identity] = (),
              stale: Mapping[int, set[ElemKey]] | None = None) -> None:
        """Work that failed, pending again (merged with what came meanwhile), retried later."""
        with self._lock:
            self._gone.update(gone)
            self._check.update(i for i in check if i not in self._gone)
            for slot, keys in (stale or {}).items():
                self._stale.setdefault(slot, set()).update(keys)
            self._retry_at = time.monotonic() + self.retry

    def _flows(self, check: set[Identity], gone: set[Identity]) -> None:
        started = time.monotonic()
        table = self._flow_table or self._new_flow_table()
        gone = {i for i in gone if self.backends(i) is None}  # one that came back is served again
        doomed: list[Flow] = []
        seen = 0
        for query in queries(check, gone):
            for flow in table.flows(query):
                seen += 1
                identity = flow.identity
                if identity is None:
                    continue
                backends = self.backends(identity)
                if (backends is None and identity in gone) or (backends is not None and stale(flow, backends)):
                    doomed.append(flow)
        deleted = table.delete(doomed) if doomed else 0
        took = time.monotonic() - started
        self.report("conntrack", deleted, took)
        if deleted or gone:
            log.info("conntrack cleaned", deleted=deleted, seen=seen, checked=len(check), gone=len(gone),
                     seconds=round(took, 4), kernel_filtered=getattr(table, "filtered", None))

    def _new_flow_table(self) -> FlowTable:
        assert self._flow_table_factory is not None
        self._flow_table = self._flow_table_factory()
        return self._flow_table

    def _affinity(self, stale_sets: dict[int, set[ElemKey]]) -> None:
        """Read each slot's set once; queue its stale entries as slices for the loop."""
        started = time.monotonic()
        reader = self._set_reader or self._new_set_reader()
        found = 0
        for slot, identities in sorted(stale_sets.items()):
            try:
                keys = [k for k in reader.entries(affinity_set(slot)) if tuple(k[1:]) in identities]
            except OSError as err:
                log.warning("reading an affinity set failed; will retry", set=affinity_set(slot), error=str(err))
                self.failed("affinity")
                self._keep(stale={slot: identities})
                continue
            found += len(keys)
            frozen = frozenset(identities)
            cuts = range(0, len(keys), self.slice_size) if keys else range(1)
            pieces = [Slice(slot, tuple(keys[i:i + self.slice_size]), frozen, i + self.slice_size >= len(keys))
                      for i in cuts]
            with self._lock:
                self._slices.extend(pieces)
        self.report("affinity-read", found, time.monotonic() - started)
        self.wake()

    def _new_set_reader(self) -> SetReader:
        self._set_reader = self._set_reader_factory()
        return self._set_reader
