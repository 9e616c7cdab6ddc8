"""The pipeline, run once per change: objects -> model -> desired -> render -> plan ->
one transaction -> cleanup and report. The Reconciler owns the mirror of the agent's
table; the loop that drives it is agent/loop.py."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import structlog

from agent import conntrack
from agent.desired import Catalog, DesiredState, ListCatalog, ObjectKey
from agent.errors import ApplyError
from agent.layout import affinity_set, identity_key
from agent.leftovers import Leftovers, leftovers
from agent.legacy import LEGACY_TABLE, takeover_commands
from agent.memory import gc_paused
from agent.model import Backend, Identity
from agent.nft import Nft
from agent.plan import Plan, plan, retire, stale_chains
from agent.render import Change, Renderer
from agent.report import Reporter
from agent.ruleset import ElemKey, Ruleset, patched
from agent.settings import Settings

log = structlog.get_logger()
FlowCleaner = Callable[[Identity, "Backend | None"], int]


@dataclass(frozen=True)
class SyncResult:
    partial: bool  # only the changed identities were evaluated and planned
    commands: int  # commands sent (0: nothing was sent)
    identities: int
    backends: int
    invalid: int
    flows_deleted: int


class Reconciler:
    """Owns the mirror of the agent's table: what the kernel holds, as last read back or
    successfully applied. Plans are made against it, so a sync with no change sends nothing.

    A sync told which objects changed re-evaluates, renders and plans only the identities
    they touch (kube-proxy's partial sync); the first sync, one after a failure, a relist
    or a periodic resync is a full one."""

    def __init__(self, settings: Settings, nft: Nft, flows: FlowCleaner | None = None,
                 reporter: Reporter | None = None) -> None:
        self.settings = settings
        self.nft = nft
        self.flows = flows or (conntrack.delete_flows if settings.conntrack else (lambda i, b: 0))
        self.reporter = reporter or Reporter()
        self.state = DesiredState(settings.gateway, settings.max_backends, settings.max_identities)
        self.renderer = Renderer(settings.affinity_set_size, settings.priority)
        self.mirror: Ruleset | None = None
        self._full = True  # read the kernel back before the next plan
        self._retiring: dict[str, float] = {}  # emptied chain -> when
        self._stale_affinity: dict[int, set[ElemKey]] = {}  # slot -> identities whose entries there are stale
        self._generation = -1  # kernel ruleset generation matching the mirror (-1: unknown)
        self._last_readback = float("-inf")

    def request_full_sync(self) -> None:
        self._full = True

    def sync(self, catalog: Catalog | Iterable[Any], changed: Iterable[ObjectKey] | None = None) -> SyncResult:
        """Bring the kernel to the desired state of the catalog's objects; `changed` names
        the objects changed since the last sync (None: unknown, evaluate everything).
        Raises ApplyError when the transaction is refused (the kernel unchanged, unless
        the error says `partial`); the next sync then reads the kernel back and is a full
        one."""
        if not hasattr(catalog, "named"):
            catalog, changed = ListCatalog(catalog), None
        with gc_paused():
            return self._sync(catalog, changed)  # type: ignore[arg-type]

    def _sync(self, catalog: Catalog, changed: Iterable[ObjectKey] | None) -> SyncResult:
        if self._full:
            self.mirror = self.nft.read()
        if changed is None or self._full or self.mirror is None:
            self.state.rebuild(catalog)
            change = self.renderer.full(self.state.services, self.mirror)
        else:
            change = self.renderer.partial(self.state.services, self.state.update(catalog, changed), self.mirror)
        self._full = False
        self.reporter.report(self.state.errors, self.state.notes)
        todo = plan(self.mirror if change.full else change.before, change.wanted, self.nft.family, self.nft.table)
        todo = todo.then(self._legacy_takeover())
        try:
            self._apply(todo)
        except ApplyError as err:
            self._full = True
            self.reporter.apply_failed(err)
            raise
        self.reporter.apply_succeeded()
        if todo:
            log.debug("transaction", commands=list(todo.commands))  # the whole batch, only with --log-level debug
        self._commit(change)
        now = time.monotonic()
        for name in stale_chains(change.before, change.wanted):
            self._retiring.setdefault(name, now)
        flows = self._clean_up(leftovers(change.before, change.wanted))
        result = SyncResult(
            partial=not change.full,
            commands=len(todo),
            identities=len(self.state.services),
            backends=self.state.backends,
            invalid=len(self.state.errors),
            flows_deleted=flows,
        )
        if todo:
            log.info("synced", **result.__dict__)
        return result

    def _commit(self, change: Change) -> None:
        """The kernel took the change: make the mirror say so."""
        self.renderer.commit(change)
        if change.full or self.mirror is None:
            self.mirror = change.wanted
        else:
            self.mirror = patched(self.mirror, change.before, change.wanted)

    def _legacy_takeover(self) -> list[dict[str, Any]]:
        if not self.settings.take_over_legacy:
            return []
        legacy = self.nft.sibling(LEGACY_TABLE).read()
        return takeover_commands(legacy, (identity_key(i) for i in self.state.services), self.nft.family)

    def _apply(self, todo: Plan) -> None:
        if not todo:
            return
        before, sent = self.nft.generation(), self.nft.transactions
        self.nft.apply(todo)
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

    def _clean_up(self, left: Leftovers) -> int:
        """After a successful apply: flows of removed identities (and UDP flows of removed
        backends) go now; stale affinity entries are noted for clean_affinity(). After the
        transaction, so no new such entry can appear."""
        flows = sum(self.flows(identity, backend) for identity, backend in left.flows)
        for slot, identities in left.affinity.items():
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
