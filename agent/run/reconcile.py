"""The pipeline, run once per change: objects -> model -> desired -> render -> plan ->
one transaction -> cleanup and report. The Reconciler owns the mirror of the agent's
table and plans through its Planner (agent/run/planner.py, the pure half); the loop that
drives it is agent/run/loop.py; agent/run/daemon.py wires it to the kernel."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, ContextManager, Iterable, Protocol

import structlog

from agent.run.cleanup import Cleanup, Slice
from agent.core.commands import Command, Table
from agent.core.desired import Catalog, ListCatalog, ObjectKey
from agent.core.health import Target
from agent.errors import ApplyError
from agent.kernel.view import Damage
from agent.core.layout import identity_key
from agent.core.leftovers import leftovers
from agent.core.legacy import LEGACY_TABLE, takeover_commands
from agent.memory import gc_paused, trim
from agent.kernel.nft import Nft
from agent.core.plan import Plan, element_count, one_transaction, retire, stale_chains
from agent.core.render import Change
from agent.ops.report import Reporter
from agent.run.planner import Planner
from agent.core.ruleset import EMPTY, ElemKey, Ruleset, key_json, patched
from agent.settings import Settings

log = structlog.get_logger()

# Elements beyond which a transaction is large: the view stops listening while it runs
# (its notifications cost the kernel ~2 us each) and the heap is trimmed after it.
LARGE_TRANSACTION = 1000


class View(Protocol):
    """The agent's table as the kernel holds it (agent/kernel/view.py's KernelView; in unit
    tests, the fake's)."""

    def fileno(self) -> int | None: ...
    def read(self) -> Ruleset | None: ...
    def read_other(self, table: str) -> Ruleset | None: ...
    def damage(self) -> Damage: ...
    def keep_up(self) -> None: ...
    def missed(self) -> bool: ...
    def deaf(self, commits: Callable[[], int]) -> ContextManager[None]: ...
    def reread(self, damage: Damage, mirror: Ruleset) -> Ruleset: ...
    def entries(self, name: str) -> list[ElemKey]: ...


@dataclass(frozen=True)
class SyncResult:
    partial: bool  # only the changed identities were evaluated and planned
    commands: int  # commands sent (0: nothing was sent)
    identities: int
    backends: int
    invalid: int
    digest: int = 0  # the planner's digest of what serves each identity (natgw_table_digest)


class Reconciler:
    """Owns the mirror of the agent's table: what the kernel holds, as last read back or
    successfully applied. Plans are made against it, so a sync with no change sends nothing.

    A sync told which objects changed re-evaluates, renders and plans only the identities
    they touch (kube-proxy's partial sync); the first sync, one after a failure, a relist
    or a periodic resync is a full one."""

    def __init__(self, settings: Settings, nft: Nft, view: View, planner: Planner, cleanup: Cleanup,
                 reporter: Reporter) -> None:
        self.settings = settings
        self.nft = nft
        self.view = view
        self.planner = planner
        self.cleanup = cleanup  # made with planner.backends: its thread asks which backends an identity has
        self.reporter = reporter
        self.caps = planner.caps
        self.state = planner.state  # the desired state (the loop reports its errors)
        self.mirror: Ruleset | None = None
        self._full = True  # read the kernel back before the next plan
        self._retiring: dict[str, float] = {}  # emptied chain -> when
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
            change = self.planner.whole(catalog, self.mirror, self.cleanup.blocked)
        else:
            change = self.planner.partial(catalog, changed, self.mirror, self.cleanup.blocked)
        self._full = False
        self.reporter.report(self.state.errors, self.state.notes)
        todo = self.planner.plan(self.mirror if change.full else change.before, change.wanted)
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
        # After the transaction, so no new such flow or entry can appear; cleared off this path.
        left = leftovers(change.before, change.wanted)
        self.cleanup.note(change.changed, left.gone, left.affinity)
        return SyncResult(
            partial=not change.full,
            commands=len(todo),
            identities=len(self.state.services),
            backends=self.state.backends,
            invalid=len(self.state.errors),
            digest=self.planner.digest,
        )

    def _commit(self, change: Change) -> None:
        """The kernel took the change: make the mirror say so."""
        self.planner.commit(change)
        if change.full or self.mirror is None:
            self.mirror = change.wanted
        else:
            self.mirror = patched(self.mirror, change.before, change.wanted)

    def _legacy_takeover(self) -> list[dict[str, Any]]:
        if not self.settings.take_over_legacy:
            return []
        return takeover_commands(self._legacy, (identity_key(i) for i in self.state.services), self.nft.family)

    def _apply(self, todo: Plan) -> None:
        if not todo:
            return
        # Deaf only when large: a small plan of several phases (a map nft 1.0.6 declares in
        # text, in a repair) heard others' commits meanwhile, and a deaf one would have
        # turned any neighbour's commit in those ~5 ms into a read-back of everything.
        if element_count(todo.commands) <= LARGE_TRANSACTION:
            self.nft.apply(todo)
            return
        try:
            with self.view.deaf(lambda: self.nft.transactions):
                self.nft.apply(todo)
        finally:
            trim()  # what libnftables used for a large transaction goes back to the kernel

    def health_down(self, down: frozenset[Target]) -> int:
        """The health checks' down targets now; returns how many identities that changes
        (rendered at the next sync, which the loop then queues)."""
        return self.planner.set_down(down)

    def failing_open(self) -> list[Any]:
        return self.planner.failing_open()

    def take_targets(self) -> Collection[Target] | None:
        """The targets to check, if they changed since the last call (None: they did not)."""
        if not self.planner.targets_changed:
            return None
        self.planner.targets_changed = False
        return self.planner.targets.keys()

    def rules_checking(self, targets: Collection[Target]) -> dict[Target, list[str]]:
        """The valid rules whose backends these targets check, by target (for logs and Events)."""
        return self.planner.rules_checking(targets)

    def check_drift(self) -> bool:
        """Repair what others changed in the agent's table since the last look, as the
        kernel's notifications tell it (agent/kernel/view.py): the damaged objects are read
        again and the difference to the mirror sent at once, in one transaction. Returns
        True when that is not enough and a full sync (a read-back of everything) is due:
        lost notifications, the table deleted, a repair refused; or legacy objects of an
        identity the agent serves reappeared (with --take-over-legacy)."""
        damage = self.view.damage()
        if not damage or self.mirror is None:
            return False
        if (damage.others or damage.everything) and self.settings.take_over_legacy:  # everything: maybe theirs too
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
        repair = self.planner.plan(current, self.mirror)
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
        """When the reconciler has timed work next (monotonic): a chain to retire, a slice
        of stale affinity entries to delete. Empty: nothing until something happens."""
        at = [t + self.settings.retire_delay for t in self._retiring.values()]
        if self.cleanup.has_slice():
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

    def clean_affinity(self) -> int:
        """Delete one slice of stale affinity entries that the cleanup thread prepared (at
        most settings.cleanup_slice: ~20 ms of libnftables), in one transaction: the loop
        calls it once a turn, after any sync, so a change never waits behind a long delete.
        Returns how many entries the transaction named."""
        piece = self.cleanup.next_slice()
        if piece is None:
            return 0
        if piece.keys:
            try:
                self._apply(one_transaction([self._delete_entries(piece)]))
            except ApplyError as err:
                log.info("affinity delete refused (an entry expired meanwhile?); reading the set again",
                         set=piece.set_name, entries=len(piece.keys), error=err.message)
                self.cleanup.applied(piece, False)
                return 0
        self.cleanup.applied(piece, True)
        if piece.keys:
            log.info("affinity entries of removed backends deleted", set=piece.set_name, entries=len(piece.keys))
        return len(piece.keys)

    def _delete_entries(self, piece: Slice) -> Command:
        # destroy (kernel 6.3+, probed): an entry that expired meanwhile fails nothing.
        t, keys = Table(self.nft.family, self.nft.table), [key_json(k) for k in piece.keys]
        return (t.destroy_elements if self.caps.destroy else t.delete_elements)(piece.set_name, keys)
