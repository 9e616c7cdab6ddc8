"""The pipeline, run once per change: objects -> model -> desired -> render -> plan ->
one transaction -> cleanup and report. The Reconciler owns the mirror of the agent's
table; the loop that drives it is agent/loop.py."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import structlog

from agent import conntrack
from agent.caps import UNPROBED, Capabilities
from agent.desired import Catalog, DesiredState, ListCatalog, ObjectKey
from agent.errors import ApplyError
from agent.kernel import Damage
from agent.layout import affinity_set, identity_key
from agent.leftovers import Leftovers, leftovers
from agent.legacy import LEGACY_TABLE, takeover_commands
from agent.memory import gc_paused, trim
from agent.model import Backend, Identity
from agent.nft import Nft
from agent.plan import Plan, chunked, element_count, one_transaction, plan, retire, stale_chains
from agent.render import Change, Renderer
from agent.report import Reporter
from agent.ruleset import EMPTY, ElemKey, Ruleset, key_json, patched
from agent.settings import Settings

log = structlog.get_logger()
FlowCleaner = Callable[[Identity, "Backend | None"], int]


class View(Protocol):
    """The agent's table as the kernel holds it (agent/kernel.py's KernelView; in unit
    tests, the fake's)."""

    def read(self) -> Ruleset | None: ...
    def read_other(self, table: str) -> Ruleset | None: ...
    def damage(self) -> Damage: ...
    def reread(self, damage: Damage, mirror: Ruleset) -> Ruleset: ...
    def entries(self, name: str) -> list[ElemKey]: ...


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

    def __init__(self, settings: Settings, nft: Nft, view: View, flows: FlowCleaner | None = None,
                 reporter: Reporter | None = None, caps: Capabilities = UNPROBED) -> None:
        self.settings = settings
        self.nft = nft
        self.view = view
        self.caps = caps
        self.flows = flows or (conntrack.delete_flows if settings.conntrack else (lambda i, b: 0))
        self.reporter = reporter or Reporter()
        self.state = DesiredState(settings.gateway, settings.max_backends, settings.max_identities)
        self.renderer = Renderer(settings.affinity_set_size, settings.priority)
        self.mirror: Ruleset | None = None
        self._full = True  # read the kernel back before the next plan
        self._retiring: dict[str, float] = {}  # emptied chain -> when
        self._stale_affinity: dict[int, set[ElemKey]] = {}  # slot -> identities whose entries there are stale
        self._legacy: Ruleset | None = None  # the legacy table as last read (--take-over-legacy)

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
            self.mirror = self.view.read()
            if self.settings.take_over_legacy:
                self._legacy = self.view.read_other(LEGACY_TABLE)
        if changed is None or self._full or self.mirror is None:
            self.state.rebuild(catalog)
            change = self.renderer.full(self.state.services, self.mirror)
        else:
            change = self.renderer.partial(self.state.services, self.state.update(catalog, changed), self.mirror)
        self._full = False
        self.reporter.report(self.state.errors, self.state.notes)
        todo = self._plan(self.mirror if change.full else change.before, change.wanted)
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
        return result

    def _commit(self, change: Change) -> None:
        """The kernel took the change: make the mirror say so."""
        self.renderer.commit(change)
        if change.full or self.mirror is None:
            self.mirror = change.wanted
        else:
            self.mirror = patched(self.mirror, change.before, change.wanted)

    def _plan(self, current: Ruleset | None, wanted: Ruleset) -> Plan:
        todo = plan(current, wanted, self.nft.family, self.nft.table, text_maps=not self.caps.json_concat_maps)
        return chunked(todo, self.settings.max_transaction_elements)

    def _legacy_takeover(self) -> list[dict[str, Any]]:
        if not self.settings.take_over_legacy:
            return []
        return takeover_commands(self._legacy, (identity_key(i) for i in self.state.services), self.nft.family)

    def _apply(self, todo: Plan) -> None:
        if not todo:
            return
        try:
            # Between the transactions of a chunked plan the view reads the notifications
            # they caused: 100,000 at once (20,000 identities) overflowed its socket.
            self.nft.apply(todo, getattr(self.view, "keep_up", None))
        finally:
            if len(todo.phases) > 1 or element_count(todo.commands) > 1000:
                trim()  # what libnftables used for a large transaction goes back to the kernel

    def check_drift(self) -> bool:
        """Repair what others changed in the agent's table since the last look, as the
        kernel's notifications tell it (agent/kernel.py): the damaged objects are read
        again and the difference to the mirror sent at once, in one transaction. Returns
        True when that is not enough and a full sync (a read-back of everything) is due:
        lost notifications, the table deleted, a repair refused; or legacy objects of an
        identity the agent serves reappeared (with --take-over-legacy)."""
        damage = self.view.damage()
        if not damage or self.mirror is None:
            return False
        if damage.others and self.settings.take_over_legacy:
            self._legacy = self.view.read_other(LEGACY_TABLE)
            if self._legacy_takeover():
                log.info("legacy objects reappeared for identities the agent serves; taking over")
                self._full = True
                return True
        if not damage.ours():
            return False
        if damage.everything:
            # The table as a whole, compared with the mirror: what differs is repaired, the
            # mirror stays (the read-back is dropped: the agent holds one copy of the table).
            log.warning("drift: the kernel's table changed beyond what its notifications say; reading it back")
            current = self.view.read()
        else:
            current = self.view.reread(damage, self.mirror)
        repair = self._plan(current, self.mirror)
        if not repair:
            return False
        log.warning("drift: the kernel differs from what the agent programmed; repairing", commands=len(repair),
                    chains=sorted(damage.chains), sets=sorted(damage.sets), maps=sorted(damage.elements))
        try:
            self._apply(repair)
        except ApplyError as err:
            log.warning("drift repair refused; reading everything back", error=err.message)
            self._full = True
            return True
        now = time.monotonic()
        for name in stale_chains(current or EMPTY, self.mirror):
            self._retiring.setdefault(name, now)
        return False

    def due(self) -> list[float]:
        """When the reconciler has timed work next (monotonic): a chain to retire, stale
        affinity entries to clear. Empty: nothing until something happens."""
        at = [t + self.settings.retire_delay for t in self._retiring.values()]
        if self._stale_affinity:
            at.append(time.monotonic())
        return [min(at)] if at else []

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
        sync). Off the sync's path: it reads whole sets (~40 ms for 10,000 entries), and
        no such entry can appear after the transaction that unlinked it, so later is as
        good. One transaction per set; if an entry expired meanwhile (which fails the
        whole delete), what remains is read again and deleted in one more. Returns how
        many went."""
        deleted = 0
        stale, self._stale_affinity = self._stale_affinity, {}
        for slot, identities in sorted(stale.items()):
            name = affinity_set(slot)
            for attempt in (1, 2):
                keys = [k for k in self.view.entries(name) if tuple(k[1:]) in identities]
                if not keys:
                    break
                ref = {"family": self.nft.family, "table": self.nft.table, "name": name}
                try:
                    self._apply(one_transaction([{"delete": {"element": {**ref, "elem": [key_json(k) for k in keys]}}}]))
                except ApplyError as err:
                    log.info("affinity delete refused (an entry expired meanwhile?); reading the set again",
                             set=name, entries=len(keys), error=err.message, attempt=attempt)
                    continue
                deleted += len(keys)
                break
        if deleted:
            log.info("affinity entries of removed backends deleted", entries=deleted)
        return deleted


def connected(settings: Settings, reporter: Reporter | None = None) -> Reconciler:
    """A reconciler on this network namespace's kernel: libnftables to write, its own
    netlink to read and follow changes, the capabilities probed (and logged)."""
    from agent.caps import probe
    from agent.kernel import KernelView

    view = KernelView("ip", settings.table, also=(LEGACY_TABLE,) if settings.take_over_legacy else ())
    nft = Nft("ip", settings.table)
    caps = probe(nft, view, "ip", settings.table)
    log.info("capabilities", **caps.as_dict())
    return Reconciler(settings, nft, view, reporter=reporter, caps=caps)
