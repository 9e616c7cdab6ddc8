"""Desired state per identity: the rules of one EIP:port/proto grouped into one service.

`service_of` groups one identity; `DesiredState` keeps every identity's service up to date
object by object, so a change to one rule costs work for its identity only, not for all
10,000."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Collection, Iterable, Protocol

from agent.errors import RuleError
from agent.core.health import DEFAULT, Check, Target, target
from agent.core.model import (EIP_KIND, RULE_KIND, Backend, Eip, Identity, Manifest, Rule, eip_of, eip_reference,
                              index_objects, rule_of)


@dataclass(frozen=True, slots=True)
class Service:
    """What one identity must do in the data plane."""

    identity: Identity
    backends: tuple[Backend, ...]  # sorted, de-duplicated
    affinity: bool
    timeout: int  # seconds; meaningful only with affinity
    rule_names: tuple[str, ...]  # the rules behind it, sorted
    checks: tuple[Check | None, ...] = ()  # each backend's health check, in `backends` order (None: none)


def service_of(identity: Identity, members: Iterable[Rule], max_backends: int) -> tuple[Service | None, list[RuleError], str]:
    """One identity from its rules: the service (None if refused), refusals, and a note.

    Siblings that disagree on affinity (admission normally forbids it) resolve the same way
    every time: ClientIP if any sibling asks for it, with the longest timeout among those
    that do. Stickiness is the safe side: a client that needs it breaks without it, one
    that does not is still served.
    """
    members = sorted(members)  # by name, its first field (names are unique): C's tuple order, no key calls
    checks: dict[Backend, Check | None] = {}
    for r in members:  # a backend two rules name: the first name's check, whatever the order they came in
        checks.setdefault(r.backend, r.check)
    backends = tuple(sorted(checks))
    if len(backends) > max_backends:
        reason = f"identity {identity} has {len(backends)} backends, more than the limit {max_backends}"
        return None, [RuleError(RULE_KIND, r.name, "spec.internalIp", reason) for r in members], ""
    timeouts = {r.timeout for r in members if r.affinity}
    note = ""
    if timeouts and (len(timeouts) > 1 or not all(r.affinity for r in members)):
        note = f"identity {identity}: rules disagree on session affinity; using ClientIP with timeout {max(timeouts)}s"
    timeout = max(timeouts) if timeouts else 0
    return Service(identity, backends, bool(timeouts), timeout, tuple(r.name for r in members),
                   tuple(checks[b] for b in backends)), [], note


class Catalog(Protocol):
    """A source's objects, as manifests: all of them, or the copies of one name."""

    def objects(self) -> list[Manifest]: ...
    def named(self, kind: str, name: str) -> list[Manifest]: ...


ObjectKey = tuple[str, str]  # an object's (kind, name)


class DesiredState:
    """The services of one gateway, maintained object by object.

    `rebuild` evaluates every object; `update` re-evaluates only the changed objects (and,
    for a changed EIP, the rules that point at it) and returns the identities whose
    service may differ. Both give the same result: every rule grouped by identity.
    """

    def __init__(self, gateway: str, max_backends: int, max_identities: int = 20000,
                 check: Check | None = DEFAULT) -> None:
        self.gateway = gateway
        self.max_backends = max_backends
        self.max_identities = max_identities
        self.check = check  # a TCP backend's health check unless its rule says otherwise
        self._reset()

    def _reset(self) -> None:
        self.services: dict[Identity, Service] = {}
        self.backends = 0  # over all services, kept as they change
        self._eips: dict[str, Eip] = {}
        self._results: dict[str, Rule | RuleError] = {}  # this gateway's rules, valid or not
        self._invalid: dict[str, RuleError] = {}  # the RuleErrors among them
        # rule name -> EIP name(s) its copies point at (any gateway), but a valid rule's (Rule.eip)
        self._refers: dict[str, str | tuple[str, ...]] = {}
        self._members: dict[Identity, tuple[str, ...] | set[str]] = {}  # identity -> valid rule names (_add_member)
        self._identities: dict[Identity, Identity] = {}  # one Identity object for all its rules
        self._refused: dict[Identity, list[RuleError]] = {}
        self._notes: dict[Identity, str] = {}
        self._waiting: set[Identity] = set()  # valid, but over the identity limit

    @property
    def errors(self) -> list[RuleError]:
        return [*self._invalid.values(), *(e for refused in self._refused.values() for e in refused)]

    @property
    def notes(self) -> list[str]:
        return [self._notes[i] for i in sorted(self._notes)]

    def rules_checking(self, targets: Collection[Target], among: Collection[Identity]) -> dict[Target, list[str]]:
        """The valid rules whose backend each target checks, sorted, among the rules of the
        identities `among` (the planner's index names them: no scan of every rule)."""
        wanted = set(targets)
        found: dict[Target, list[str]] = {}
        for name in {n for i in among for n in self._members.get(i, ())}:
            rule = self._results.get(name)
            if type(rule) is Rule and rule.check is not None and (t := target(rule.backend, rule.check)) in wanted:
                found.setdefault(t, []).append(name)
        return {t: sorted(names) for t, names in found.items()}

    def rebuild(self, catalog: Catalog) -> set[Identity]:
        """Evaluate everything; returns every identity, before and after."""
        before = set(self.services) | set(self._refused)
        self._reset()
        by_kind = index_objects(catalog.objects())
        self._eips = {name: eip_of(name, copies) for name, copies in by_kind[EIP_KIND].items()}
        for name, copies in by_kind[RULE_KIND].items():
            self._learn_rule(name, copies)
        dirty = before | set(self._members)
        self._regroup(set(self._members))
        return dirty

    def update(self, catalog: Catalog, changed: Iterable[ObjectKey]) -> set[Identity]:
        """Re-evaluate changed objects; returns the identities that may have changed."""
        rules: set[str] = set()
        for kind, name in changed:
            if not name:
                continue  # nameless objects are nobody's, as in rebuild()
            if kind == EIP_KIND:
                copies = catalog.named(EIP_KIND, name)
                if copies:
                    self._eips[name] = eip_of(name, copies)
                else:
                    self._eips.pop(name, None)
                rules |= self._referring(name)
            elif kind == RULE_KIND:
                rules.add(name)
        dirty: set[Identity] = set()
        for name in rules:
            dirty |= self._identities_of(name)
            self._set_rule(name, catalog.named(RULE_KIND, name))
            dirty |= self._identities_of(name)
        return dirty | self._regroup(dirty)

    def _referring(self, eip: str) -> set[str]:
        """The rules whose copies point at this EIP. A scan (~3 ms at 40,000 rules, once
        per EIP change, which is rare): an index of sets per EIP cost 3 MB at 40,000."""
        found = {n for n, r in self._results.items() if type(r) is Rule and r.eip == eip}
        found.update(n for n, refs in self._refers.items() if refs == eip or (type(refs) is tuple and eip in refs))
        return found

    def _identities_of(self, name: str) -> set[Identity]:
        result = self._results.get(name)
        return {result.identity} if isinstance(result, Rule) else set()

    def _set_rule(self, name: str, copies: list[Manifest]) -> None:
        old = self._results.pop(name, None)
        self._invalid.pop(name, None)
        if isinstance(old, Rule):
            self._drop_member(old.identity, name)
        self._refers.pop(name, None)
        if copies:
            self._learn_rule(name, copies)

    def _learn_rule(self, name: str, copies: list[Manifest]) -> None:
        """Evaluate a rule the state holds nothing of (forgotten by _set_rule, or a rebuild)."""
        result = rule_of(name, copies, self._eips, self.gateway, self._identities, self.check)
        if isinstance(result, Rule):
            self._add_member(result.identity, name)  # its EIP is result.eip: nothing in _refers
        else:
            # Every copy's EIP (a directory may hold two copies pointing at different EIPs).
            refs = tuple({ref for c in copies if (ref := eip_reference(c)) is not None})
            if refs:
                self._refers[name] = refs[0] if len(refs) == 1 else refs
            if result is not None:
                self._invalid[name] = result
        if result is not None:
            self._results[name] = result

    def _add_member(self, identity: Identity, name: str) -> None:
        """A tuple while small (an identity has a few rules; a set of four names takes 216
        bytes, a tuple 72: 1.4 MB at 10,000 identities), a set beyond 16 (removal stays
        O(1) for an identity with thousands)."""
        held = self._members.get(identity)
        if held is None:
            self._members[identity] = (name,)
        elif type(held) is tuple:
            self._members[identity] = (*held, name) if len(held) < 16 else {*held, name}
        else:
            held.add(name)  # type: ignore[union-attr]

    def _drop_member(self, identity: Identity, name: str) -> None:
        held = self._members.get(identity)
        if type(held) is tuple:
            self._members[identity] = tuple(n for n in held if n != name)
        elif held is not None:
            held.discard(name)  # type: ignore[union-attr]

    def _regroup(self, identities: set[Identity]) -> set[Identity]:
        """Recompute these identities' services; returns identities admitted on top (ones
        waiting for room under the identity limit)."""
        for identity in sorted(identities):
            if (gone := self.services.pop(identity, None)) is not None:
                self.backends -= len(gone.backends)
            self._refused.pop(identity, None)
            self._notes.pop(identity, None)
            self._waiting.discard(identity)
            names = self._members.get(identity)
            if not names:
                self._members.pop(identity, None)
                self._identities.pop(identity, None)
                continue
            members = [self._results[n] for n in names]
            service, refused, note = service_of(identity, members, self.max_backends)  # type: ignore[arg-type]
            if service is not None and len(self.services) >= self.max_identities:
                # One more identity than the gateway may carry: refused until room frees
                # up, so no batch of objects can exhaust it.
                reason = f"the gateway already serves the maximum of {self.max_identities} identities"
                refused = [RuleError(RULE_KIND, n, "spec.eip", f"identity {identity}: {reason}") for n in sorted(names)]
                service = None
                self._waiting.add(identity)
            if service is not None:
                self.services[identity] = service
                self.backends += len(service.backends)
            if refused:
                self._refused[identity] = refused
            if note:
                self._notes[identity] = note
        room = self.max_identities - len(self.services)
        if room > 0 and self._waiting and not identities & self._waiting:
            admitted = set(sorted(self._waiting)[:room])
            self._regroup(admitted)
            return admitted
        return set()


class ListCatalog:
    """A plain list of manifests as a Catalog."""

    def __init__(self, objects: Iterable[Manifest]) -> None:
        self._objects = list(objects)
        self._named: dict[ObjectKey, list[Manifest]] | None = None

    def objects(self) -> list[Manifest]:
        return self._objects

    def named(self, kind: str, name: str) -> list[Manifest]:
        if self._named is None:
            self._named = defaultdict(list)
            for obj in self._objects:
                self._named[(obj.kind, obj.name)].append(obj)
        return self._named.get((kind, name), [])
