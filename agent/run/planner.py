"""The pure half of a sync: objects -> desired state -> the rendered table -> the plan
against the kernel's table. It reads and writes nothing: the Reconciler
(agent/run/reconcile.py) plans every sync through it, and `natgw-agent render` and `diff`
(agent/run/oneshot.py) print its preview, so what they show is what a sync would send."""
from __future__ import annotations

from typing import Collection, Mapping

from agent.core.desired import Catalog, DesiredState, ObjectKey
from agent.core.layout import CONSISTENT_CHAIN
from agent.core.model import Backend, Identity
from agent.core.plan import Plan, chunked, plan
from agent.core.render import NO_BLOCKS, Change, Renderer, hairpin_of
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
        self.state = DesiredState(settings.gateway, settings.max_backends, settings.max_identities)
        self.renderer = Renderer(settings.affinity_set_size, settings.priority, hairpin_of(settings),
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
        return self.renderer.full(self.state.services, current, blocked)

    def partial(self, catalog: Catalog, changed: Collection[ObjectKey], mirror: Ruleset,
                blocked: Blocked = NO_BLOCKS) -> Change:
        """Only the changed objects evaluated, only the identities they touch rendered."""
        return self.renderer.partial(self.state.services, self.state.update(catalog, changed), mirror, blocked)

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
