"""The agent's view of its own table, over its own netlink (agent/kernel/nfnetlink.py and
agent/kernel/nftread.py), never through a libnftables listing.

Why (measured here, nft 1.0.6 to 1.1.3): libnftables' listings differ in form across versions and
restart their whole-ruleset dump whenever any table commits: with a neighbour committing
every 100 ms, a listing of 10,000 identities never returned, and the agent stalled. Here
only the agent's table is dumped (10,000 x 4 in ~0.25 s, quiet or under that neighbour),
decoded by meaning into the forms render.py writes, so a read-back compares with == on
every version.

Drift comes from the kernel's change notifications (NFNLGRP_NFTABLES, what `nft monitor`
reads), not from polling: `damage()` keeps only those naming the agent's table that no
socket of this process sent (the kernel puts the committing socket's port id on each), so
another table's commits cost a message's header each (~2 us) and the agent's own commits,
affinity cleanup included, are never taken for drift. An overrun, or a change to the
table itself, asks for a full read-back."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Iterator

import structlog

from agent.kernel import nfnetlink as nl
from agent.kernel import nftread as nr
from agent.kernel import nftuapi as uapi
from agent.core.layout import (CHASH, Counters, affinity_slot, backend_counters, backend_slot, chash_bucket,
                               elements_under, fold_buckets)
from agent.core.ruleset import Elem, ElemKey, Ruleset, element, holds

log = structlog.get_logger()

_OBJECT_NAME = {uapi.NFT_MSG_NEWCHAIN: uapi.NFTA_CHAIN_NAME, uapi.NFT_MSG_DELCHAIN: uapi.NFTA_CHAIN_NAME,
                uapi.NFT_MSG_NEWRULE: uapi.NFTA_RULE_CHAIN, uapi.NFT_MSG_DELRULE: uapi.NFTA_RULE_CHAIN,
                uapi.NFT_MSG_NEWSET: uapi.NFTA_SET_NAME, uapi.NFT_MSG_DELSET: uapi.NFTA_SET_NAME,
                uapi.NFT_MSG_NEWSETELEM: uapi.NFTA_SET_ELEM_LIST_SET, uapi.NFT_MSG_DELSETELEM: uapi.NFTA_SET_ELEM_LIST_SET}
_CHAIN_MSGS = {uapi.NFT_MSG_NEWCHAIN, uapi.NFT_MSG_DELCHAIN, uapi.NFT_MSG_NEWRULE, uapi.NFT_MSG_DELRULE}
_SET_MSGS = {uapi.NFT_MSG_NEWSET, uapi.NFT_MSG_DELSET}
_ELEMENT_MSGS = {uapi.NFT_MSG_NEWSETELEM, uapi.NFT_MSG_DELSETELEM}
# Others' notifications for the agent's table kept while a sync waits (the loop drains the
# socket so it does not spin): beyond this many, a full read-back costs less than keeping them.
_CARRIED_MAX = 20000


@dataclass(frozen=True)
class Damage:
    """What others changed in the agent's table (and the tables it also watches) since
    the last look."""

    everything: bool = False  # lost notifications, or the table itself went or came: read it all back
    chains: frozenset[str] = frozenset()  # chains whose declaration or rules changed
    sets: frozenset[str] = frozenset()  # sets and maps declared, deleted or redeclared
    elements: frozenset[str] = frozenset()  # maps whose elements changed
    others: frozenset[str] = frozenset()  # other watched tables that changed (the legacy one)

    def __bool__(self) -> bool:
        return self.everything or bool(self.chains or self.sets or self.elements or self.others)

    def ours(self) -> bool:
        return self.everything or bool(self.chains or self.sets or self.elements)


NONE = Damage()


def damage_of(messages: Iterable[nl.Message], family: str, table: str, own: Collection[int],
              also: Collection[str] = (), overrun: bool = False) -> tuple[Damage, set[int]]:
    """What `messages` (notifications) say others changed, and the port ids they came
    from that are not in `own` (so the caller can check whether those are its own
    sockets, opened since). Element changes of dynamic sets (affinity entries) are not
    damage: the agent never manages their contents; nor are anonymous sets', which come
    and go with the rules that hold them."""
    fam = uapi.FAMILIES[family]
    chains: set[str] = set()
    sets: set[str] = set()
    elements: set[str] = set()
    others: set[str] = set()
    unknown: set[int] = set()
    everything = overrun
    for m in messages:
        if m.subsys != nl.NFNL_SUBSYS_NFTABLES or m.msg == uapi.NFT_MSG_NEWGEN or m.family != fam:
            continue
        name_of = nr.names_table(m)
        if name_of != table and name_of not in also:
            continue
        if m.portid in own:
            continue
        unknown.add(m.portid)
        if name_of != table:
            others.add(name_of)
            continue
        if m.msg in (uapi.NFT_MSG_NEWTABLE, uapi.NFT_MSG_DELTABLE):
            everything = True
            continue
        attr = _OBJECT_NAME.get(m.msg)
        try:
            name = nl.get_str(m.attrs()[attr]) if attr is not None else None
        except (KeyError, ValueError, nl.MalformedError):
            name = None
        if name is None:
            everything = True  # a change to the table we cannot place: read it all back
        elif name.startswith("__") and m.msg not in _CHAIN_MSGS:
            continue  # an anonymous set (__set0, __map1): part of its rule, which is named on its own
        elif m.msg in _CHAIN_MSGS:
            chains.add(name)
        elif m.msg in _SET_MSGS:
            sets.add(name)
        elif m.msg in _ELEMENT_MSGS and affinity_slot(name) is None:
            elements.add(name)
    return Damage(everything, frozenset(chains), frozenset(sets), frozenset(elements), frozenset(others)), unknown


@dataclass
class KernelView:
    """The agent's table (and, read-only, the tables it also watches) as the kernel holds
    it. Create it in the gateway's network namespace; its sockets stay bound there."""

    family: str
    table: str
    also: tuple[str, ...] = ()  # other tables whose changes matter (the legacy one, for take-over)
    subscribe: bool = True  # follow change notifications (False: read only, e.g. for `show`)
    _sock: nl.NfSocket = field(init=False, repr=False)
    _sub: nl.Subscriber | None = field(init=False, repr=False)
    _own: set[int] = field(init=False, repr=False)
    _carried: list[nl.Message] = field(init=False, repr=False, default_factory=list)
    _overrun: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        self._sub = nl.Subscriber() if self.subscribe else None  # first: nothing committed from now on goes unseen
        self._sock = nl.NfSocket()
        self._own = nl.own_portids()

    def fileno(self) -> int | None:
        """Readable when change notifications wait (for the loop's select); None: a
        read-only view follows none."""
        return self._sub.fileno() if self._sub is not None else None

    def close(self) -> None:
        self._sock.close()
        if self._sub is not None:
            self._sub.close()

    def read(self) -> Ruleset | None:
        """The whole table, consistent as of one generation (None: there is none). What
        was pending before is superseded; commits after it are kept for damage()."""
        state = self.read_state()
        return None if state is None else state.ruleset()

    def read_state(self) -> nr.TableState | None:
        """read(), with the counters and dynamic sets' entries too (for `show`). Not kept:
        the reconciler's mirror is the one copy of the table the agent holds."""
        self._own |= nl.own_portids()  # libnftables' socket, opened since (~1 ms)
        if self._sub is not None:
            self._sub.drain(skip=self._own)  # superseded by the read, as is what keep_up() kept
        self._carried, self._overrun = [], False
        state = nr.read_table(self.family, self.table, sock=self._sock, subscriber=self._sub)
        if state is not None:
            self._carried = [m for m in nr.commits_after(state.notifications, state.generation)
                            if m.portid not in self._own]
        return state

    def read_other(self, table: str) -> Ruleset | None:
        """Another table, read-only (the legacy one, for --take-over-legacy)."""
        state = nr.read_table(self.family, table, sock=self._sock)
        return None if state is None else state.ruleset()

    def keep_up(self) -> None:
        """Read the notifications waiting now (the agent's own dropped unread, other tables'
        dropped), so a long run of the agent's own transactions cannot overflow the socket
        and a loop waiting to sync is not woken again by them; what others sent about the
        watched tables waits for damage()."""
        if self._sub is not None:
            drained = self._sub.drain(skip=self._own)
            watched = (self.table, *self.also)
            self._carried.extend(m for m in drained.messages if nr.names_table(m) in watched)
            self._overrun = self._overrun or drained.overrun
            if len(self._carried) > _CARRIED_MAX:  # kept unlooked-at for long: one read-back instead
                self._carried, self._overrun = [], True

    @contextlib.contextmanager
    def deaf(self, commits: Callable[[], int]) -> Iterator[None]:
        """The agent's own large transactions (a full sync) with this view deaf to them:
        with no listener the kernel builds no notifications at all (measured at 10,000
        identities x 4: 0.50 -> 0.41 s for the transactions, 50,000 notifications not
        built, nor read back). Others' commits meanwhile go unheard too: the generation
        after, less the one before, less the agent's own commits (`commits()`, a running
        count) tells whether there were any; if so, the next damage() asks for a full
        read-back. (Another listener, such as `nft monitor`, makes the kernel build them
        anyway; nothing else changes.)"""
        start = self._generation() if self._sub is not None else None
        if start is None:  # nothing to listen to, or no generation to tell by: listening on
            yield
            return
        assert self._sub is not None
        self.keep_up()
        ours = commits()
        self._sub.listen(False)
        try:
            yield
        finally:
            # Listening again first: a commit between the two is both heard and counted
            # (a read-back for nothing at worst), never neither.
            self._sub.listen(True)
            end = self._generation()
            if end is None or (end - start) & 0xFFFFFFFF != commits() - ours:
                self._overrun = True

    def _generation(self) -> int | None:
        try:
            return nr.generation(self._sock)
        except (OSError, nl.MalformedError, KeyError) as err:  # NetlinkError is an OSError
            log.warning("cannot read the ruleset generation", error=str(err))
            return None

    def missed(self) -> bool:
        """Notifications were lost (an overrun, or others' commits while deaf): a drift
        check is due though nothing may come to wake the loop for it."""
        return self._overrun

    def damage(self) -> Damage:
        """What others changed since the last look (nothing: NONE)."""
        assert self._sub is not None, "a read-only view follows no changes"
        drained = self._sub.drain(skip=self._own)
        messages = [*self._carried, *drained.messages]
        overrun, self._carried, self._overrun = drained.overrun or self._overrun, [], False
        found, unknown = damage_of(messages, self.family, self.table, self._own, self.also, overrun)
        if unknown:
            # A socket of ours opened since (libnftables opens its socket at its first
            # command): learn our port ids again, once, before calling it someone else's.
            self._own |= nl.own_portids()
            if unknown & self._own:
                found, _ = damage_of(messages, self.family, self.table, self._own, self.also, overrun)
        return found

    def reread(self, damage: Damage, mirror: Ruleset) -> Ruleset:
        """The mirror with the damaged objects as the kernel now holds them."""
        return reread(damage, mirror, self._head, self._elements)

    def _head(self) -> Ruleset | None:
        head = nr.read_table(self.family, self.table, elements=False, sock=self._sock)
        return None if head is None else head.ruleset()

    def _elements(self, name: str) -> dict[ElemKey, Any] | None:
        """One map's elements; for CHASH, every chash map's, folded."""
        if name != CHASH:
            found = nr.read_set(self.family, self.table, name, sock=self._sock)
            return None if found is None else {e.key: element(e.value, e.comment) for e in found}
        head = nr.read_table(self.family, self.table, elements=False, sock=self._sock)
        maps = [n for n in (head.sets if head is not None else ()) if chash_bucket(n) is not None]
        if not maps:
            return None
        read = {n: nr.read_set(self.family, self.table, n, sock=self._sock) or [] for n in maps}
        return fold_buckets({n: {e.key: element(e.value, e.comment) for e in found} for n, found in read.items()})

    def declaration(self, name: str) -> dict[str, Any] | None:
        """One set's declaration as the kernel holds it (None: no such set)."""
        head = nr.read_table(self.family, self.table, elements=False, sock=self._sock)
        return None if head is None else head.sets.get(name)

    def entries(self, name: str) -> list[ElemKey]:
        """The keys of a dynamic set (an affinity set's pinned clients)."""
        found = nr.read_set(self.family, self.table, name, sock=self._sock)
        return [] if found is None else [e.key for e in found]

    def counters(self) -> Counters:
        """{("eip:port/proto", "ip:port"): (packets, bytes)} from the backend maps'
        per-element counters, read now (one dump per backend map, nothing else)."""
        head = nr.read_table(self.family, self.table, elements=False, sock=self._sock)
        elements: dict[str, dict[ElemKey, Elem]] = {}
        counters: dict[str, dict[ElemKey, tuple[int, int]]] = {}
        for name in sorted(head.sets if head is not None else ()):
            if backend_slot(name) is None:
                continue
            found = nr.read_set(self.family, self.table, name, sock=self._sock) or ()
            elements[name] = {e.key: element(e.value, e.comment) for e in found}
            counters[name] = {e.key: e.counter for e in found if e.counter is not None}
        return backend_counters(elements, counters)


def reread(damage: Damage, mirror: Ruleset, head: Callable[[], Ruleset | None],
           elements: Callable[[str], dict[ElemKey, Elem] | None]) -> Ruleset:
    """`mirror` with the damaged objects as the kernel now holds them: declarations,
    chains and rules read again (`head()`: no elements, ~1 ms) if any of them changed,
    and the elements of each damaged map (`elements(name)`: ~40 ms for 10,000)."""
    current = mirror
    if damage.sets or damage.chains:
        fresh = head()
        if fresh is None:
            return Ruleset()
        kept = {n: e for n, e in mirror.elements.items() if holds(n, fresh.sets)}
        kept.update({elements_under(n): {} for n, d in fresh.sets.items()
                     if n not in mirror.sets and "map" in d and elements_under(n) not in kept})
        current = Ruleset(fresh.sets, fresh.chains, fresh.rules, kept)
    maps = {elements_under(n) for n in damage.elements} | {elements_under(n) for n in damage.sets
                                                          if elements_under(n) in current.elements}
    if maps:
        patched = dict(current.elements)
        for name in maps:
            found = elements(name)
            if found is None:
                patched.pop(name, None)
            else:
                patched[name] = found
        current = Ruleset(current.sets, current.chains, current.rules, patched)
    return current
