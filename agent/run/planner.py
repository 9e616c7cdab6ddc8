"""The pure half of a sync: objects -> desired state -> the rendered table -> the plan
against the kernel's table. It reads and writes nothing: the Reconciler
(agent/run/reconcile.py) plans every sync through it, and `natgw-agent render` and `diff`
(agent/run/oneshot.py) print its preview, so what they show is what a sync would send."""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import replace
from typing import Collection, Iterator, Mapping

from agent.core.desired import Catalog, DesiredState, ObjectKey, Service
from agent.core.health import DEFAULT, Check, Target, usable
from agent.core.layout import CONSISTENT_CHAIN
from agent.core.model import Backend, Identity
from agent.core.plan import Plan, chunked, plan
from agent.core.render import NO_BLOCKS, Change, Renderer, snat_of
from agent.core.ruleset import Ruleset
from agent.kernel.caps import Capabilities
from agent.ops.report import Reporter
from agent.settings import Settings

FAMILY = "ip"  # the agent's table is an ip table (agent/kernel/nft.py writes it, agent/kernel/view.py reads it)

Blocked = Mapping[Identity, Collection[int]]


class Planner:
    """Holds the desired state, object by object, and the renderer's memory of the pieces
    the kernel holds; plans with the probed capabilities (`caps`)."""

    def __init__(self, settings: Settings, caps: Capabilities) -> None:
        self.settings = settings
        self.caps = caps
        self.state = DesiredState(settings.gateway, settings.max_backends, settings.max_identities, default_check(settings))
        self.down: frozenset[Target] = frozenset()  # targets whose backends leave the choice (health.py)
        self._dirty: set[Identity] = set()  # identities a health change touched, for the next partial render
        self._targets: dict[Identity, tuple[Target, ...]] = {}  # each identity's checks
        self.targets: Counter[Target] = Counter()  # every check the services need, deduplicated
        self.targets_changed = False  # a target came or went since the health checks were told
        # target -> the identities it checks: built at the first health change, then kept in
        # step, so a batch of transitions costs what it names, not a scan of 10,000 identities.
        self._serving: dict[Target, list[Identity]] | None = None
        self._failing: list[Identity] | None = None  # failing_open()'s answer until down or targets change
        # Per identity a stable hash of what serves it (usable backends, affinity), summed:
        # `digest`, kept in step with what each sync renders (a partial one hashes only
        # the identities it renders: 0.02 ms for 10; a whole one 24 ms at 10,000 x 4, beside
        # its 430 ms render; measured here), so replicas can compare theirs (natgw_table_digest).
        self._hashes: dict[Identity, int] = {}
        self._sum = 0
        self.digest = 0
        self.renderer = Renderer(settings.affinity_set_size, settings.priority, snat_of(settings),
                                 settings.consistent_choice)

    def backends(self, identity: Identity) -> tuple[Backend, ...] | None:
        """An identity's backends as desired now (None: not served). The cleanup thread
        asks too: one dict get(), atomic, of whichever services dict is current."""
        service = self.state.services.get(identity)
        return None if service is None else service.backends

    def whole(self, catalog: Catalog, current: Ruleset | None, blocked: Blocked = NO_BLOCKS) -> Change:
        """Every object evaluated, every identity rendered, with the slots `current` (the
        kernel's table; None: none) holds."""
        self.state.rebuild(catalog)
        self._dirty.clear()
        self._count_targets(None)
        self._hash(None)
        return self.renderer.full(_Usable(self.state.services, self.down), current, blocked)

    def partial(self, catalog: Catalog, changed: Collection[ObjectKey], mirror: Ruleset,
                blocked: Blocked = NO_BLOCKS) -> Change:
        """Only the changed objects evaluated, only the identities they touch (or a health
        change did) rendered."""
        identities = self.state.update(catalog, changed) | self._dirty
        self._dirty = set()
        self._count_targets(identities)
        self._hash(identities)
        return self.renderer.partial(_Usable(self.state.services, self.down), identities, mirror, blocked)

    def set_down(self, down: frozenset[Target]) -> int:
        """The targets that are down now; the identities whose choice that changes are
        rendered at the next partial sync. Returns how many (0: no sync needed)."""
        flipped = down ^ self.down
        self.down = down
        if not flipped:
            return 0
        self._failing = None
        serving = self._index()
        touched = {i for t in flipped for i in serving.get(t, ())}
        self._dirty |= touched
        return len(touched)

    def failing_open(self) -> list[Identity]:
        """Identities whose every backend is down: they keep them all (health.usable)."""
        if not self.down:
            return []
        if self._failing is None:
            serving, targets, down = self._index(), self._targets, self.down
            candidates = {i for t in down for i in serving.get(t, ())}
            self._failing = sorted(i for i in candidates if all(t in down for t in targets[i])
                                   and len(targets[i]) == len(self.state.services[i].backends))
        return self._failing

    def rules_checking(self, targets: Collection[Target]) -> dict[Target, list[str]]:
        """The valid rules whose backends these targets check (for logs and Events), found
        through the identities they serve."""
        serving = self._index()
        return self.state.rules_checking(targets, {i for t in targets for i in serving.get(t, ())})

    def _index(self) -> dict[Target, list[Identity]]:
        if self._serving is None:  # ~30 ms at 10,000 identities x 4, once
            serving: dict[Target, list[Identity]] = {}
            for i, ts in self._targets.items():
                for t in ts:
                    serving.setdefault(t, []).append(i)
            self._serving = serving
        return self._serving

    def _count_targets(self, identities: Collection[Identity] | None) -> None:
        """Keep `targets` in step with the services (None: all of them changed), and
        `targets_changed` true once a target came or went."""
        self._failing = None
        if identities is None:  # in one pass, C's counting: ~20 ms at 10,000 x 4 (a loop took 60)
            self._targets = {i: ts for i, s in self.state.services.items() if (ts := _targets_of(s))}
            self.targets = Counter(t for ts in self._targets.values() for t in ts)
            self.targets_changed = True
            self._serving = None
            return
        counts, serving = self.targets, self._serving
        for identity in identities:
            old = self._targets.pop(identity, ())
            service = self.state.services.get(identity)
            new = _targets_of(service) if service is not None else ()
            if new:
                self._targets[identity] = new
            if new == old:  # a health change re-renders an identity with the same checks
                continue
            # The new counted before the old go: a target the identity keeps never reaches
            # 0, which would tell the prober that all 40,000 changed (a target per identity
            # in the bench: each batch of a mass failure cost it ~45 ms, and the loop a
            # Tracker.keep() of 40,000 under the checks' lock).
            for t in new:
                if t not in counts:
                    self.targets_changed = True
                counts[t] += 1
                if serving is not None:
                    serving.setdefault(t, []).append(identity)
            for t in old:
                counts[t] -= 1
                if serving is not None:
                    serving[t].remove(identity)
                if not counts[t]:
                    del counts[t]
                    if serving is not None:
                        del serving[t]
                    self.targets_changed = True

    def _hash(self, identities: Collection[Identity] | None) -> None:
        """Bring `digest` up to the services as rendered now (None: all of them changed).
        The sum is independent of order and history; each term is Python-independent
        (blake2b of the text), so replicas that serve alike agree."""
        usable = _Usable(self.state.services, self.down)
        if identities is None:
            self._hashes, self._sum = {}, 0
            identities = usable
        for identity in identities:
            self._sum -= self._hashes.pop(identity, 0)
            service = usable.get(identity)
            if service is not None:
                text = f"{identity} {service.affinity} {service.timeout} {' '.join(map(str, service.backends))}"
                term = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
                self._hashes[identity] = term
                self._sum += term
        # 2**52: a float (a metric's value) holds it exactly.
        self.digest = self._sum % (1 << 52)

    def plan(self, current: Ruleset | None, wanted: Ruleset) -> Plan:
        """The change from `current` (None: no table) to `wanted`, in the transactions the
        kernel is sent (agent/core/plan.py's chunked)."""
        todo = plan(current, wanted, FAMILY, self.settings.table, text_maps=not self.caps.json_concat_maps)
        return chunked(todo, self.settings.max_transaction_elements, last=(CONSISTENT_CHAIN,))

    def commit(self, change: Change) -> None:
        """The kernel took the change: the next partial one starts from its pieces."""
        self.renderer.commit(change)

    def preview(self, catalog: Catalog, current: Ruleset | None, reporter: Reporter) -> Plan:
        """What a full sync of `catalog` would send to a kernel holding `current` (None: no
        table), as the sync makes it (whole, then plan), reporting what was left out."""
        change = self.whole(catalog, current)
        reporter.report(self.state.errors, self.state.notes)
        return self.plan(current, change.wanted)


CHECK_SETTINGS = ("health_checks", "health_interval", "health_timeout", "health_rise", "health_fall")
# What shapes the table beside the rules (render.snat_of, the consistent choice).
TABLE_SETTINGS = ("hairpin_snat", "vpc_interface", "hairpin_mark", "masquerade", "masquerade_mark",
                  "consistent_choice")


def reported(settings: Settings, names: Collection[str]) -> dict[str, bool | float | int | str]:
    """These settings, for the status socket: `diff` plans with the running agent's, so a
    backend its checks took out, or its masquerade, matches whatever flags diff got."""
    return {name: getattr(settings, name) for name in names}


def with_reported(settings: Settings, found: Mapping[str, object], names: Collection[str]) -> Settings:
    """`settings` with reported() ones as a running agent gave them (ValueError if malformed)."""
    try:
        return replace(settings, **{name: type(getattr(settings, name))(found[name])  # type: ignore[call-arg]
                                    for name in names if name in found})
    except (TypeError, ValueError) as err:
        raise ValueError(f"not the agent's settings: {err}") from None


def default_check(settings: Settings) -> Check | None:
    """How a TCP backend is checked when its rule does not say (None: not at all)."""
    if not settings.health_checks:
        return None
    return DEFAULT._replace(interval=settings.health_interval, timeout=settings.health_timeout,
                            rise=settings.health_rise, fall=settings.health_fall)


def _targets_of(service: Service) -> tuple[Target, ...]:
    # health.target() inlined: 40,000 a full sync.
    return tuple((b if c.port is None else b._replace(port=c.port), c)
                 for b, c in zip(service.backends, service.checks) if c is not None)


class _Usable(Mapping[Identity, Service]):
    """The services as the renderer must see them: a service with a backend down offers
    only the usable ones (health.usable). A view, not a copy: a partial sync looks up a
    few of 10,000."""

    def __init__(self, services: Mapping[Identity, Service], down: frozenset[Target]) -> None:
        self._services = services
        self._down = down

    def __getitem__(self, identity: Identity) -> Service:
        service = self._services[identity]
        if not self._down:
            return service
        backends = usable(service.backends, service.checks, self._down)
        if backends is service.backends:
            return service
        checks = dict(zip(service.backends, service.checks))
        return replace(service, backends=backends, checks=tuple(checks[b] for b in backends))

    def __iter__(self) -> Iterator[Identity]:
        return iter(self._services)

    def __len__(self) -> int:
        return len(self._services)
