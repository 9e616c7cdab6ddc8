"""The pipeline, run once per change: objects -> model -> desired -> render -> plan ->
one transaction -> cleanup and report. And the loop that drives it from a source."""
from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import structlog

from agent import conntrack
from agent.errors import ApplyError
from agent.health import Health
from agent.model import Backend, Identity
from agent.nft import Nft
from agent.plan import plan, retire, stale_chains
from agent.report import Reporter, evaluate
from agent.render import SERVICES, affinity_set, identity_key, key_identity, render, slots_of, sticky_slots
from agent.ruleset import EMPTY, Ruleset
from agent.settings import Settings

log = structlog.get_logger()
FlowCleaner = Callable[[Identity, "Backend | None"], int]


@dataclass(frozen=True)
class SyncResult:
    commands: int  # commands sent in the one transaction (0: nothing was sent)
    identities: int
    backends: int
    invalid: int
    flows_deleted: int
    affinity_deleted: int


class Reconciler:
    """Owns the mirror of the agent's table: what the kernel holds, as last read back or
    successfully applied. Plans are made against it, so a sync with no change sends nothing."""

    def __init__(self, settings: Settings, nft: Nft, flows: FlowCleaner | None = None,
                 reporter: Reporter | None = None) -> None:
        self.settings = settings
        self.nft = nft
        self.flows = flows or (conntrack.delete_flows if settings.conntrack else (lambda i, b: 0))
        self.mirror: Ruleset | None = None
        self._full = True  # read the kernel before the next plan
        self.reporter = reporter or Reporter()
        self._retiring: dict[str, float] = {}  # emptied chain -> when

    def request_full_sync(self) -> None:
        self._full = True

    def sync(self, objects: Iterable[Any]) -> SyncResult:
        """Bring the kernel to the desired state of these objects. Raises ApplyError (the
        kernel unchanged) when the transaction is refused; the next sync reads back first."""
        desired, invalid = evaluate(objects, self.settings, self.reporter)
        if self._full:
            self.mirror = self.nft.read()
            self._full = False
        before = self.mirror
        wanted = render(desired.services, before or EMPTY, self.settings.affinity_set_size, self.settings.priority)
        commands = plan(before, wanted, self.nft.family, self.nft.table)
        try:
            self.nft.apply(commands)
        except ApplyError as err:
            self._full = True
            self.reporter.apply_failed(err)
            raise
        self.reporter.apply_succeeded()
        self.mirror = wanted
        now = time.monotonic()
        for name in stale_chains(before, wanted):
            self._retiring.setdefault(name, now)
        flows, affinity = self._cleanup(before or EMPTY, wanted)
        result = SyncResult(
            commands=len(commands),
            identities=len(desired.services),
            backends=sum(len(s.backends) for s in desired.services.values()),
            invalid=invalid,
            flows_deleted=flows,
            affinity_deleted=affinity,
        )
        if commands:
            log.info("synced", **result.__dict__)
        return result

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
            self.nft.apply(retire(due, self.nft.family, self.nft.table))
        except ApplyError as err:
            # Someone removed them already, or still points at them: a read-back sorts it out.
            log.warning("retiring chains failed; will read back", chains=len(due), error=err.message)
            self._full = True

    def _cleanup(self, before: Ruleset, after: Ruleset) -> tuple[int, int]:
        """After a successful apply: flows of removed identities (and UDP flows of removed
        backends) and affinity entries that no longer point at their backend. Done after
        the transaction, so no new such entry can appear meanwhile."""
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
        affinity = 0
        for slot, identities in sorted(stale.items()):
            name = affinity_set(slot)
            if name not in after.sets:
                continue  # the set itself went, entries with it
            keys = [k for k in self.nft.set_elements(name) if tuple(k[1:]) in identities]
            affinity += self.nft.delete_elements(name, keys)
        return flows, affinity


class Source(Protocol):
    """Where objects come from: a directory or the Kubernetes API."""

    @property
    def ready(self) -> bool: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def poll(self) -> bool: ...
    def wants_full_sync(self) -> bool: ...
    def objects(self) -> list[Any]: ...


def run_loop(settings: Settings, source: Source, reconciler: Reconciler, stop: threading.Event,
             health: Health | None = None) -> None:
    """Poll the source, sync on change, retry failures with capped, jittered backoff and a
    full read-back, resync periodically. Survives any exception from any stage."""
    health = health or Health(settings.healthz_stale_after, settings.livez_wedged_after)
    pending = True
    delay = settings.retry_min
    retry_at = 0.0
    resync_at = time.monotonic() + settings.resync_interval
    while not stop.is_set():
        health.beat()
        now = time.monotonic()
        try:
            pending |= source.poll()
            if source.wants_full_sync():
                reconciler.request_full_sync()
                pending = True
        except Exception:  # a source bug must not kill the data plane's keeper
            log.exception("source poll failed")
        if now >= resync_at:
            reconciler.request_full_sync()
            resync_at = now + settings.resync_interval
            pending = True
        if pending:
            health.pending()
        if pending and source.ready and now >= retry_at:
            try:
                reconciler.sync(source.objects())
                pending, delay = False, settings.retry_min
                health.synced()
            except ApplyError as err:
                health.failed(str(err))
                log.error("apply failed; kernel unchanged, will read back and retry",
                          rc=err.rc, digest=err.digest, commands=err.commands, error=err.message, retry_in=round(delay, 2))
            except Exception as err:
                health.failed(f"{type(err).__name__}: {err}")
                log.exception("sync failed; will read back and retry", retry_in=round(delay, 2))
            if pending:
                reconciler.request_full_sync()
                retry_at = now + delay * random.uniform(0.8, 1.2)
                delay = min(delay * 2, settings.retry_max)
        try:
            reconciler.retire_chains()
        except Exception:
            log.exception("retiring chains failed")
        stop.wait(settings.poll_interval)
