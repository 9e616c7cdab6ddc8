"""The pipeline, run once per change: objects -> model -> desired -> render -> plan ->
one transaction -> cleanup and report. And the loop that drives it from a source."""
from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import structlog

from agent import conntrack
from agent.backoff import Backoff
from agent.errors import ApplyError
from agent.health import Health
from agent.legacy import LEGACY_TABLE, takeover_commands
from agent.metrics import Metrics
from agent.model import Backend, Identity
from agent.nft import Nft
from agent.plan import plan, retire, stale_chains
from agent.desired import Catalog, DesiredState, Key, ListCatalog
from agent.report import Reporter
from agent.render import (SERVICES, Pieces, Shared, affinity_set, assign_slots, declare, held_slots, identity_key,
                          key_identity, render_all, render_service, slots_of, sticky_slots, undeclare)
from agent.ruleset import EMPTY, Ruleset
from agent.settings import Settings

log = structlog.get_logger()
FlowCleaner = Callable[[Identity, "Backend | None"], int]


@dataclass(frozen=True)
class SyncResult:
    partial: bool  # only the changed identities were evaluated and planned
    commands: int  # commands sent in the one transaction (0: nothing was sent)
    identities: int
    backends: int
    invalid: int
    flows_deleted: int


class Reconciler:
    """Owns the mirror of the agent's table: what the kernel holds, as last read back or
    successfully applied. Plans are made against it, so a sync with no change sends nothing.

    A sync told which objects changed re-evaluates, renders and plans only the identities
    they touch (kube-proxy's partial sync); the first sync, one after a failure, a relist
    or a periodic resync covers everything."""

    def __init__(self, settings: Settings, nft: Nft, flows: FlowCleaner | None = None,
                 reporter: Reporter | None = None) -> None:
        self.settings = settings
        self.nft = nft
        self.flows = flows or (conntrack.delete_flows if settings.conntrack else (lambda i, b: 0))
        self.reporter = reporter or Reporter()
        self.state = DesiredState(settings.gateway, settings.max_backends, settings.max_identities)
        self.mirror: Ruleset | None = None
        self._pieces: dict[Identity, Pieces] = {}  # per identity, as in the mirror
        self._usage: Counter[str] = Counter()  # shared object -> identities needing it
        self._full = True  # read the kernel back before the next plan
        self._retiring: dict[str, float] = {}  # emptied chain -> when
        self._stale_affinity: dict[int, set[Key]] = {}  # slot -> identities whose entries there are stale
        self._generation = -1  # kernel ruleset generation matching the mirror (-1: unknown)
        self._last_readback = float("-inf")

    def request_full_sync(self) -> None:
        self._full = True

    def sync(self, catalog: Catalog | Iterable[Any], changed: Iterable[Key] | None = None) -> SyncResult:
        """Bring the kernel to the desired state of the catalog's objects; `changed` names
        the objects changed since the last sync (None: unknown, evaluate everything).
        Raises ApplyError when the transaction is refused (the kernel unchanged, unless
        the error says `partial`); the next sync then reads the kernel back and covers
        everything."""
        if not hasattr(catalog, "named"):
            catalog, changed = ListCatalog(catalog), None
        with _gc_paused():
            return self._sync(catalog, changed)  # type: ignore[arg-type]

    def _sync(self, catalog: Catalog, changed: Iterable[Key] | None) -> SyncResult:
        if self._full:
            self.mirror = self.nft.read()
        if changed is None or self._full or self.mirror is None:
            self.state.rebuild(catalog)
            change = self._render_all()
        else:
            change = self._render_some(self.state.update(catalog, changed))
        self._full = False
        self.reporter.report(self.state.errors, self.state.notes)
        commands = plan(self.mirror if change.whole else change.before, change.wanted, self.nft.family, self.nft.table)
        commands += self._legacy_takeover()
        try:
            self._apply(commands)
        except ApplyError as err:
            self._full = True
            self.reporter.apply_failed(err)
            raise
        self.reporter.apply_succeeded()
        if commands:
            log.debug("transaction", commands=commands)  # the whole batch, only with --log-level debug
        self._commit(change)
        now = time.monotonic()
        for name in stale_chains(change.before, change.wanted):
            self._retiring.setdefault(name, now)
        flows = self._cleanup(change.before, change.wanted)
        result = SyncResult(
            partial=not change.whole,
            commands=len(commands),
            identities=len(self.state.services),
            backends=self.state.backends,
            invalid=len(self.state.errors),
            flows_deleted=flows,
        )
        if commands:
            log.info("synced", **result.__dict__)
        return result

    def _render_all(self) -> _Change:
        before = self.mirror or EMPTY
        wanted, pieces = render_all(self.state.services, before, self.settings.affinity_set_size, self.settings.priority)
        return _Change(True, before, wanted, pieces, set(), Counter())

    def _render_some(self, dirty: set[Identity]) -> _Change:
        """The mirror and the desired table restricted to the dirty identities' elements,
        with every shared object: what plan() needs to diff just those identities."""
        assert self.mirror is not None
        before, wanted = _shell(self.mirror), _shell(self.mirror)
        usage: Counter[str] = Counter()
        pieces: dict[Identity, Pieces] = {}
        definitions: dict[str, Shared] = {}
        for identity in dirty:
            old = self._pieces.get(identity)
            if old is not None:
                for name, elem in old.elements.items():
                    before.elements[name][old.key] = elem
                usage.subtract(old.shared.keys())
            service = self.state.services.get(identity)
            if service is not None:
                held = assign_slots({identity: service}, {identity: held_slots(old)} if old else {})[identity]
                new = pieces[identity] = render_service(service, held, self.settings.affinity_set_size)
                usage.update(new.shared.keys())
                definitions.update(new.shared)
        for name, delta in usage.items():
            had = self._usage[name]
            if had == 0 and delta > 0:
                declare(wanted, name, definitions[name])
            elif had > 0 and had + delta == 0:
                undeclare(wanted, name)
        for new in pieces.values():
            for name, elem in new.elements.items():
                wanted.elements[name][new.key] = elem
        return _Change(False, before, wanted, pieces, dirty, usage)

    def _commit(self, change: _Change) -> None:
        """The kernel took the transaction: make the mirror say so."""
        if change.whole:
            self.mirror, self._pieces = change.wanted, change.pieces
            patterns = Counter(id(p.shared) for p in change.pieces.values())
            shared = {id(p.shared): p.shared for p in change.pieces.values()}
            self._usage = Counter()
            for key, count in patterns.items():
                for name in shared[key]:
                    self._usage[name] += count
            return
        assert self.mirror is not None
        elements = self.mirror.elements
        for identity in change.dirty:
            old = self._pieces.pop(identity, None)
            if old is not None:
                for name in old.elements:
                    elements[name].pop(old.key, None)
        for name in [n for n in elements if n not in change.wanted.sets]:
            del elements[name]
        for name in change.wanted.sets:
            if name in change.wanted.elements:
                elements.setdefault(name, {})
        for identity, new in change.pieces.items():
            self._pieces[identity] = new
            for name, elem in new.elements.items():
                elements[name][new.key] = elem
        self.mirror = Ruleset(change.wanted.sets, change.wanted.chains, change.wanted.rules, elements)
        self._usage.update(change.usage)
        self._usage = +self._usage  # drop the zeros

    def _legacy_takeover(self) -> list[dict[str, Any]]:
        if not self.settings.take_over_legacy:
            return []
        legacy = self.nft.sibling(LEGACY_TABLE).read()
        return takeover_commands(legacy, (identity_key(i) for i in self.state.services), self.nft.family)

    def _apply(self, commands: list[dict[str, Any]]) -> None:
        if not commands:
            return
        before, sent = self.nft.generation(), self.nft.transactions
        self.nft.apply(commands)
        # Exactly as many generations later as transactions we sent (two when new backend
        # maps were declared first): no one else's came in between, so the drift check
        # may trust it; anything else makes the next check read back.
        ours = before + self.nft.transactions - sent
        self._generation = ours if self.nft.generation() == ours else -1

    def check_drift(self) -> bool:
        """Cheap unless something changed: the kernel's ruleset generation moves with every
        committed transaction (dynamic set updates from packets do not move it). Only when
        it moved past our own last transaction is the table read back and compared.
        Returns True (and asks for a full sync) when the kernel differs from the mirror."""
        generation = self.nft.generation()
        if generation == self._generation or self.mirror is None:
            return False
        now = time.monotonic()
        if now - self._last_readback < self.settings.drift_readback_gap:
            return False  # a busy neighbour must not keep us listing: check again shortly
        self._last_readback = now
        kernel = self.nft.read()
        drift = plan(kernel, self.mirror, self.nft.family, self.nft.table)
        if not drift:
            self._generation = generation  # someone else's table changed, not ours
            if self._legacy_takeover():
                log.info("legacy objects reappeared for identities the agent serves; taking over")
                return True  # the next sync removes them
            return False
        log.warning("drift: the kernel differs from what the agent programmed; repairing",
                    commands=len(drift), generation=generation)
        self.request_full_sync()
        return True

    def retire_chains(self) -> None:
        """Delete chains emptied at least retire_delay ago that are still unused."""
        if not self._retiring:
            return
        used = self.mirror.chains if self.mirror is not None else {}
        now = time.monotonic()
        due = sorted(n for n, t in self._retiring.items() if n not in used and now - t >= self.settings.retire_delay)
        for name in [n for n in self._retiring if n in used]:
            del self._retiring[name]  # in use again
        if not due:
            return
        for name in due:
            del self._retiring[name]
        try:
            self._apply(retire(due, self.nft.family, self.nft.table))
        except ApplyError as err:
            # Someone removed them already, or still points at them: a read-back sorts it out.
            log.warning("retiring chains failed; will read back", chains=len(due), error=err.message)
            self._full = True

    def _cleanup(self, before: Ruleset, after: Ruleset) -> int:
        """After a successful apply: flows of removed identities (and UDP flows of removed
        backends) go now; affinity entries that no longer point at their backend are noted
        for clean_affinity(). After the transaction, so no new such entry can appear."""
        if not before.elements.get(SERVICES):
            return 0  # nothing was there to go (a start from an empty table)
        before, after = _differing(before, after)
        if not before.elements.get(SERVICES):
            return 0  # no identity that was there changed
        flows = 0
        old_ids = {key_identity(k) for k in before.elements.get(SERVICES, {})}
        new_ids = {key_identity(k) for k in after.elements.get(SERVICES, {})}
        for identity in sorted(old_ids - new_ids):
            flows += self.flows(identity, None)
        old_slots, new_slots = slots_of(before), slots_of(after)
        for identity in sorted(old_ids & new_ids):
            if identity.proto != "udp":
                continue  # a TCP flow finishes on its backend; a UDP one would never move
            for backend in sorted(set(old_slots.get(identity, {})) - set(new_slots.get(identity, {}))):
                flows += self.flows(identity, backend)
        stale: dict[int, set[tuple[Any, ...]]] = defaultdict(set)
        new_sticky = sticky_slots(after)
        for identity, held in sticky_slots(before).items():
            for slot, backend in held.items():
                if new_sticky.get(identity, {}).get(slot) != backend:
                    stale[slot].add(identity_key(identity))
        for slot, identities in stale.items():
            if affinity_set(slot) in after.sets:  # else the set itself went, entries with it
                self._stale_affinity.setdefault(slot, set()).update(identities)
        return flows

    def clean_affinity(self) -> int:
        """Delete the affinity entries that no longer point at their backend (noted by a
        sync). Off the sync's path: it lists whole sets (~90 ms at 10,000 identities), and
        no such entry can appear after the transaction that unlinked it, so later is as
        good. Returns how many went."""
        deleted = 0
        stale, self._stale_affinity = self._stale_affinity, {}
        for slot, identities in sorted(stale.items()):
            name = affinity_set(slot)
            keys = [k for k in self.nft.set_elements(name) if tuple(k[1:]) in identities]
            deleted += self.nft.delete_elements(name, keys)
        if deleted:
            log.info("affinity entries of removed backends deleted", entries=deleted)
        return deleted


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """A whole sync allocates ~10 objects per rule while 100,000s stay alive; the cyclic
    collector would rescan them all many times over (measured: half of a 10k-identity
    sync). Reference counting still frees everything acyclic meanwhile. Afterwards every
    object alive (gc.freeze is process-wide: the sync's long-lived state, and whatever
    other threads hold) is frozen out of the collector, else the first collection after
    a whole sync scans all of it (75 ms at 10k identities, then 210 ms for the next full
    one). Frozen objects are still freed by reference counting; cyclic garbage among them
    waits for collect_cycles(), once per resync interval."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.enable()


def collect_cycles() -> None:
    """Collect cyclic garbage among frozen objects too (once per resync interval: it scans
    the whole heap, ~0.2 s at 10,000 identities)."""
    gc.unfreeze()
    gc.collect()


@dataclass(frozen=True)
class _Change:
    """One sync's plan input: the table before and wanted (whole, or only the dirty
    identities' elements with every shared object), and what to remember on success."""

    whole: bool
    before: Ruleset
    wanted: Ruleset
    pieces: dict[Identity, Pieces]
    dirty: set[Identity]
    usage: Counter[str]  # shared object -> change in the number of identities needing it


def _shell(rs: Ruleset) -> Ruleset:
    """The shared part of a table (declarations and chains) with empty maps."""
    return Ruleset(dict(rs.sets), dict(rs.chains), dict(rs.rules), {name: {} for name in rs.elements})


def _differing(before: Ruleset, after: Ruleset) -> tuple[Ruleset, Ruleset]:
    """Both tables restricted to the elements of identities that differ between them."""
    keys = set()
    for name in set(before.elements) | set(after.elements):
        old, new = before.elements.get(name, {}), after.elements.get(name, {})
        keys.update(k for k, e in old.items() if new.get(k) != e)
        keys.update(k for k, e in new.items() if old.get(k) != e)
    return (Ruleset(before.sets, before.chains, before.rules,
                    {n: {k: e for k, e in m.items() if k in keys} for n, m in before.elements.items()}),
            Ruleset(after.sets, after.chains, after.rules,
                    {n: {k: e for k, e in m.items() if k in keys} for n, m in after.elements.items()}))


class Source(Protocol):
    """Where objects come from: a directory or the Kubernetes API."""

    @property
    def ready(self) -> bool: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def poll(self) -> bool: ...
    def take_changes(self) -> set[Key] | None: ...
    def objects(self) -> list[Any]: ...
    def named(self, kind: str, name: str) -> list[Any]: ...


def run_loop(settings: Settings, source: Source, reconciler: Reconciler, stop: threading.Event,
             health: Health | None = None, metrics: Metrics | None = None) -> None:
    """Poll the source, sync on change, retry failures with capped, jittered backoff and a
    full read-back, check for drift, resync periodically. Survives any exception from any
    stage: each is logged with its context and retried, never a silent thread death."""
    health = health or Health(settings.healthz_stale_after, settings.livez_wedged_after)
    metrics = metrics or Metrics()
    backoff = Backoff(settings.retry_min, settings.retry_max)
    pending = True
    queued_at = time.time()  # when the oldest change not yet in the kernel was seen

    def queue() -> None:
        nonlocal pending, queued_at
        if not pending:
            pending, queued_at = True, time.time()
    retry_at = 0.0
    now = time.monotonic()
    resync_at = now + settings.resync_interval
    drift_at = now + settings.drift_interval
    while not stop.is_set():
        health.beat()
        now = time.monotonic()
        try:
            if source.poll():
                queue()
        except Exception:  # a source bug must not kill the data plane's keeper
            log.exception("source poll failed")
        if now >= resync_at:
            collect_cycles()
            reconciler.request_full_sync()
            resync_at = now + settings.resync_interval
            queue()
        if now >= drift_at and not pending:
            drift_at = now + settings.drift_interval
            try:
                if reconciler.check_drift():
                    queue()
            except Exception:
                log.exception("drift check failed; resyncing")
                reconciler.request_full_sync()
                queue()
        if pending:
            health.pending()
            metrics.last_queued.set(queued_at)
        if pending and source.ready and now >= retry_at:
            started = time.monotonic()
            try:
                result = reconciler.sync(source, source.take_changes())
                pending = False
                backoff.reset()
                health.synced()
                _record(metrics, reconciler, result, time.monotonic() - started, time.time() - queued_at)
            except ApplyError as err:
                health.failed(str(err))
                metrics.failures.inc()
                delay = backoff.next()
                log.error("apply failed; will read back and retry", kernel_unchanged=not err.partial,
                          rc=err.rc, digest=err.digest, commands=err.commands, error=err.message, retry_in=round(delay, 2))
                retry_at = now + delay
            except Exception as err:
                health.failed(f"{type(err).__name__}: {err}")
                metrics.failures.inc()
                delay = backoff.next()
                log.exception("sync failed; will read back and retry", retry_in=round(delay, 2))
                retry_at = now + delay
            if pending:
                reconciler.request_full_sync()
        if hasattr(source, "restarts"):
            metrics.watch_counts(source.restarts, source.relists)  # type: ignore[attr-defined]
        try:
            reconciler.retire_chains()
            reconciler.clean_affinity()
        except Exception:
            log.exception("post-sync cleanup failed")
        stop.wait(settings.poll_interval)


def _record(metrics: Metrics, reconciler: Reconciler, result: SyncResult, took: float, waited: float) -> None:
    metrics.sync_duration.labels("partial" if result.partial else "full").observe(took)
    metrics.last_sync.set(time.time())
    if result.commands:
        metrics.programming.observe(waited)
    metrics.identities.set(result.identities)
    metrics.backends.set(result.backends)
    metrics.set_invalid(reconciler.state.errors)
    if result.flows_deleted:
        metrics.conntrack_deleted.inc(result.flows_deleted)
