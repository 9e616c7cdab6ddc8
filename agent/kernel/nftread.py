"""One nf_tables table read over the agent's own netlink (agent/kernel/nfnetlink.py), decoded
into the agent's canonical forms: exactly what agent/core/render.py renders and what
agent/core/ruleset.py from_listing() parses from nft 1.0.6's `nft -j list table`.
Sets, elements and chains decode in agent/kernel/nftobjects.py, rules in
agent/kernel/nftrule.py; this reads them consistently.

Why not libnftables' listing: its JSON differs across nftables versions, and it restarts
its whole-ruleset dump whenever the generation moves, so with another table committing
every 100 ms a large table never lists. Here only this table's objects are dumped (all
messages first, decoded after: the dumps take ~40 ms at 50,000 elements), and a pass is
kept when this table did not change during it: either the generation did not move, or
the notifications of the commits meanwhile (subscribed before the first dump) name no
object of this table. Otherwise it reads again, a bounded number of times.
NLM_F_DUMP_INTR alone could not tell: the kernel (6.18) flags chain, rule and set dumps
but never an element dump, and flags another table's commit too.

What the kernel filters (verified on 6.18): set and rule dumps by table, element dumps
by set; chain dumps only by family (every table's chains come), so chains are filtered
here."""
from __future__ import annotations

import errno as errnos
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from agent.core.layout import in_render_form
from agent.core.ruleset import Elem, ElemKey, Ruleset, element
from agent.kernel import nfnetlink as nl
from agent.kernel.nfnetlink import MalformedError, Message, NetlinkError, NfSocket, Subscriber
from agent.kernel.nftobjects import Element, SetInfo, decode_chain, decode_set, decode_sets, elements_of
from agent.kernel.nftrule import decode_rule
from agent.kernel.nftuapi import (
    FAMILIES, NFT_CHAIN_BINDING, NFT_MSG_GETCHAIN, NFT_MSG_GETGEN, NFT_MSG_GETRULE, NFT_MSG_GETSET,
    NFT_MSG_GETSETELEM, NFT_MSG_GETTABLE, NFT_MSG_NEWGEN, NFT_SET_OBJECT, NFTA_CHAIN_TABLE, NFTA_GEN_ID,
    NFTA_RULE_CHAIN, NFTA_RULE_TABLE, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_NAME,
    NFTA_SET_TABLE, NFTA_TABLE_NAME)
from agent.memory import gc_paused


@dataclass(frozen=True)
class TableState:
    """One table's objects in the agent's canonical forms. Equality compares content
    (not the generation it was read at)."""

    sets: dict[str, dict[str, Any]]  # named sets and maps -> declaration
    chains: dict[str, dict[str, Any]]  # name -> declaration ({} for a regular chain)
    rules: dict[str, tuple[dict[str, Any], ...]]  # chain -> its rules, in order
    elements: dict[str, dict[ElemKey, Elem]]  # map -> key -> Elem(value, comment)
    counters: dict[str, dict[ElemKey, tuple[int, int]]]  # map -> key -> (packets, bytes)
    entries: dict[str, list[tuple[ElemKey, int | None]]]  # plain set -> [(key, ms to expiry)], sorted
    generation: int = field(default=0, compare=False)
    set_info: dict[str, SetInfo] = field(default_factory=dict, compare=False, repr=False)
    notifications: tuple[Message, ...] = field(default=(), compare=False, repr=False)
    attempts: int = field(default=1, compare=False)  # passes read_table made
    interrupted: bool = field(default=False, compare=False)  # the kept pass saw NLM_F_DUMP_INTR

    def ruleset(self) -> Ruleset:
        """The table in render.py's form (`elements` holds one entry per kernel element)."""
        return in_render_form(Ruleset(sets=self.sets, chains=self.chains, rules=self.rules, elements=self.elements))


class TableChanged(NetlinkError):
    """The table changed during every one of the bounded read attempts."""


def generation(sock: NfSocket) -> int:
    m = sock.request(NFT_MSG_GETGEN, 0)
    if m is None:
        raise NetlinkError(errnos.EPROTO, "getgen", "no answer")
    return nl.get_be32(m.attrs()[NFTA_GEN_ID])


def dump_table(sock: NfSocket, family: int, table: str, elements: bool = True) -> tuple[TableState | None, bool]:
    """One pass over the table's objects: (state or None if the table does not exist,
    whether any dump was interrupted)."""
    interrupted = False

    def run(dump: nl.Dump) -> list[Message]:
        nonlocal interrupted
        msgs = list(dump)
        interrupted |= dump.interrupted
        return msgs

    try:
        sock.request(NFT_MSG_GETTABLE, family, [nl.attr_str(NFTA_TABLE_NAME, table)])
    except NetlinkError as err:
        if err.errno == errnos.ENOENT:
            return None, False
        raise
    set_msgs = run(sock.dump(NFT_MSG_GETSET, family, [nl.attr_str(NFTA_SET_TABLE, table)]))
    elem_msgs: dict[str, list[Message]] = {}
    infos = decode_sets(set_msgs)
    for name, info in infos.items():
        if info.anonymous or elements:
            elem_msgs[name] = run(sock.dump(NFT_MSG_GETSETELEM, family, _elements_of_set(table, name)))
    chain_msgs = run(sock.dump(NFT_MSG_GETCHAIN, family, [nl.attr_str(NFTA_CHAIN_TABLE, table)]))
    rule_msgs = run(sock.dump(NFT_MSG_GETRULE, family, [nl.attr_str(NFTA_RULE_TABLE, table)]))
    state = assemble(family, table, set_msgs, elem_msgs, chain_msgs, rule_msgs, elements, infos=infos)
    return state, interrupted


def _elements_of_set(table: str, name: str) -> list[bytes]:
    """A GETSETELEM request's attributes: all the elements of one set."""
    return [nl.attr_str(NFTA_SET_ELEM_LIST_TABLE, table), nl.attr_str(NFTA_SET_ELEM_LIST_SET, name)]


def assemble(family: int, table: str, set_msgs: Iterable[Message], elem_msgs: Mapping[str, Iterable[Message]],
             chain_msgs: Iterable[Message], rule_msgs: Iterable[Message], elements: bool = True,
             gen: int = 0, infos: dict[str, SetInfo] | None = None) -> TableState:
    """Decode dumped messages into a TableState (the pure half of read_table; never
    raises). Without `elements`, named sets' and maps' contents are left out (maps are
    then absent from .elements, not empty). `infos`: the sets, if already decoded.

    The cyclic GC is held off meanwhile (memory.gc_paused): the ~200,000 acyclic objects
    of 50,000 elements would otherwise trigger a dozen collections (measured: 0.22 -> 0.18 s
    at 10k x 4)."""
    set_msgs = list(set_msgs)
    with gc_paused():
        return _assemble(family, table, set_msgs, elem_msgs, chain_msgs, rule_msgs, elements, gen,
                         decode_sets(set_msgs) if infos is None else infos)


def _assemble(family: int, table: str, set_msgs: list[Message], elem_msgs: Mapping[str, Iterable[Message]],
              chain_msgs: Iterable[Message], rule_msgs: Iterable[Message], elements: bool, gen: int,
              infos: dict[str, SetInfo]) -> TableState:
    sets: dict[str, dict[str, Any]] = {}
    elems: dict[str, dict[ElemKey, Elem]] = {}
    counters: dict[str, dict[ElemKey, tuple[int, int]]] = {}
    entries: dict[str, list[tuple[ElemKey, int | None]]] = {}
    anon: dict[str, list[Element]] = {}
    key_caches: dict[tuple[Any, ...], dict[bytes, ElemKey]] = {}
    for m in set_msgs:  # a set message that did not decode: marked under its name if known
        try:
            a = m.attrs()
            name = nl.get_str(a[NFTA_SET_NAME])
        except (MalformedError, KeyError, ValueError):
            continue
        if name not in infos and nl.get_str(a.get(NFTA_SET_TABLE, b"")) in (table, ""):
            sets[name] = {"opaque": "malformed set"}
    for name, info in infos.items():
        if info.table not in (table, ""):
            continue
        cache = key_caches.setdefault((info.key_types, info.key_len, info.key_host_order), {})
        found = elements_of(elem_msgs.get(name, ()), info, cache)
        if info.anonymous:
            anon[name] = found
            continue
        sets[name] = info.decl
        if not elements:
            continue
        if info.is_map or info.flags & NFT_SET_OBJECT:
            elems[name] = {e.key: element(e.value, e.comment) for e in found}
            if any(e.counter is not None for e in found):
                counters[name] = {e.key: e.counter for e in found if e.counter is not None}
        else:
            entries[name] = sorted(((e.key, e.expires_ms) for e in found), key=repr)  # not hash order
    chains: dict[str, dict[str, Any]] = {}
    bindings: set[str] = set()
    for m in chain_msgs:
        try:
            a = m.attrs()
            if nl.get_str(a.get(NFTA_CHAIN_TABLE, b"")) != table or m.family != family:
                continue
            name, decl, flags = decode_chain(a, family)
        except (MalformedError, KeyError, ValueError, struct.error, IndexError):
            continue
        if flags & NFT_CHAIN_BINDING:  # an anonymous chain (`jump { ... }`): listed inside its rule
            bindings.add(name)
            continue
        chains[name] = decl
    rules: dict[str, list[dict[str, Any]]] = {name: [] for name in chains}
    for m in rule_msgs:
        try:
            a = m.attrs()
            if nl.get_str(a.get(NFTA_RULE_TABLE, b"")) != table or m.family != family:
                continue
            chain = nl.get_str(a[NFTA_RULE_CHAIN])
        except (MalformedError, KeyError, ValueError):
            continue
        if chain in bindings:
            continue
        rules.setdefault(chain, []).append(decode_rule(a, family, infos, anon, bindings))
    return TableState(sets=sets, chains=chains, rules={c: tuple(r) for c, r in rules.items()}, elements=elems,
                      counters=counters, entries=entries, generation=gen, set_info=infos)


# The table's name is attribute 1 of every object: NFTA_TABLE_NAME, NFTA_CHAIN_TABLE,
# NFTA_RULE_TABLE, NFTA_SET_TABLE, NFTA_SET_ELEM_LIST_TABLE, NFTA_OBJ_TABLE, NFTA_FLOWTABLE_TABLE.
TABLE_OF_OBJECT = 1


def names_table(m: Message) -> str | None:
    """The table an nf_tables object notification names."""
    try:
        for t, x, y in nl.iter_attrs(m.buf, m.start, m.end):
            if t == TABLE_OF_OBJECT:
                return nl.get_str(m.buf[x:y])
    except MalformedError:
        return None
    return None


def gen_after(a: int, b: int) -> bool:
    """a is b or later, in u32 wrap-around order."""
    return ((a - b) & 0xFFFFFFFF) < 0x80000000


class Commits:
    """Notifications grouped by the commit they belong to: each commit's object messages
    come before its NFT_MSG_NEWGEN, which carries the commit's generation (None: it could
    not be read, so the commit counts as later than any). Fed as messages arrive."""

    def __init__(self) -> None:
        self.pending: list[Message] = []  # a commit still without its NEWGEN
        self.commits: list[tuple[int | None, list[Message]]] = []  # (generation, its object messages)
        self.seen: list[Message] = []

    def add(self, messages: Iterable[Message]) -> None:
        for m in messages:
            self.seen.append(m)
            if m.subsys != nl.NFNL_SUBSYS_NFTABLES:
                continue
            if m.msg != NFT_MSG_NEWGEN:
                self.pending.append(m)
                continue
            try:
                gen: int | None = nl.get_be32(m.attrs()[NFTA_GEN_ID])
            except (KeyError, ValueError, struct.error):  # MalformedError is a ValueError
                gen = None
            self.commits.append((gen, self.pending))
            self.pending = []

    def last_gen(self) -> int | None:
        return next((gen for gen, _ in reversed(self.commits) if gen is not None), None)

    def after(self, generation: int) -> list[Message]:
        """The object messages of the commits later than `generation`, then those of a
        commit still without its NEWGEN."""
        later = [m for gen, msgs in self.commits
                 if gen is None or (gen != generation and gen_after(gen, generation)) for m in msgs]
        return later + self.pending

    def touched(self, family: int, table: str, since: int, first: int = 0) -> bool:
        """Whether a commit numbered `since` or later, among commits[first:], or a
        commit still without its NEWGEN changed this table (or did not say which)."""
        msgs = [m for gen, ms in self.commits[first:] if gen is None or gen_after(gen, since) for m in ms]
        return any(m.family == family and names_table(m) in (table, None) for m in msgs + self.pending)


def commits_after(messages: Iterable[Message], generation: int) -> list[Message]:
    """The object notifications of the commits after `generation` (and of one still in
    flight), among `messages` (what a read_table drained: TableState.notifications)."""
    commits = Commits()
    commits.add(messages)
    return commits.after(generation)


def read_table(family: str, table: str, *, elements: bool = True, sock: NfSocket | None = None,
               subscriber: Subscriber | None = None, attempts: int = 8, settle: float = 1.0,
               timeout: float | None = None) -> TableState | None:
    """The table's objects, consistent as of `generation`; None when it does not exist.

    Subscribes (or uses `subscriber`; what it drains is in .notifications) before the
    first dump, reads the generation before and after, and keeps the pass when the
    generation did not move or when every commit between the two (their notifications,
    waited for up to `settle` s) left this table alone; a pass that found an object
    gone between two of its dumps (ENOENT) is not kept either. Raises TableChanged after
    `attempts` passes that each overlapped a change of this table, NetlinkError on
    kernel errors."""
    fam = FAMILIES[family]
    own_sock = sock is None
    sock = sock or NfSocket(timeout=timeout or nl.DEFAULT_TIMEOUT)
    own_sub = subscriber is None
    try:
        sub = subscriber if subscriber is not None else Subscriber()
    except OSError:  # no notifications (not permitted): the generation alone decides
        sub = None
    commits = Commits()
    try:
        for attempt in range(1, attempts + 1):
            if sub is not None:
                commits.add(sub.drain().messages)  # commits announced by now finished before gen0
            mark = len(commits.commits)
            gen0 = generation(sock)
            try:
                state, interrupted = dump_table(sock, fam, table, elements)
            except NetlinkError as err:
                if err.errno != errnos.ENOENT:
                    raise
                # What an earlier dump of the pass listed was deleted before its own dump
                # (a set before its elements: `show` during a sync, seen in CI): changed.
                continue
            gen1 = generation(sock)
            if _consistent(sub, commits, mark, fam, table, gen0, gen1, settle):
                if state is None:
                    return None
                return TableState(state.sets, state.chains, state.rules, state.elements, state.counters,
                                  state.entries, gen1, state.set_info, tuple(commits.seen), attempt, interrupted)
        raise TableChanged(errnos.EAGAIN, f"read {family} {table}", f"changed during {attempts} reads")
    finally:
        if own_sub and sub is not None:
            sub.close()
        if own_sock:
            sock.close()


def _consistent(sub: Subscriber | None, commits: Commits, mark: int, family: int, table: str, gen0: int,
                gen1: int, settle: float) -> bool:
    """Whether the pass between reading gen0 and gen1 saw the table as of one generation.

    Unmoved, it did, except if commit gen0 itself was still activating its objects when
    gen0 was read (the kernel bumps the generation just before): that commit's
    notifications, if they arrived since, are checked. Moved, every commit from gen0 to
    gen1 must have left the table alone; they are waited for (NFT_MSG_NEWGEN of gen1 comes last)
    up to `settle` s. False when unsure (an overrun, or no notifications at all)."""
    if sub is None:
        return gen0 == gen1
    deadline = time.monotonic() + settle
    while True:
        drained = sub.drain()
        commits.add(drained.messages)
        if drained.overrun:
            return False
        if gen0 == gen1:
            return not commits.touched(family, table, gen0, mark)
        last = commits.last_gen()
        if last is not None and gen_after(last, gen1):
            return not commits.touched(family, table, gen0, mark)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        sub.wait(min(remaining, 0.05))


def read_set(family: str, table: str, name: str, *, sock: NfSocket | None = None) -> list[Element] | None:
    """One set's elements (keys, data, comments, counters, expiry), without the rest of
    the table: two round trips. None when the table or set does not exist."""
    fam = FAMILIES[family]
    own = sock is None
    sock = sock or NfSocket()
    try:
        try:
            m = sock.request(NFT_MSG_GETSET, fam, [nl.attr_str(NFTA_SET_TABLE, table),
                                                   nl.attr_str(NFTA_SET_NAME, name)])
        except NetlinkError as err:
            if err.errno == errnos.ENOENT:
                return None
            raise
        if m is None:
            return None
        info = decode_set(m.attrs(), fam)
        try:
            return elements_of(sock.dump(NFT_MSG_GETSETELEM, fam, _elements_of_set(table, name)), info)
        except NetlinkError as err:
            if err.errno == errnos.ENOENT:
                return None
            raise
    finally:
        if own:
            sock.close()
