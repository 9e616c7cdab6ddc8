"""A decoder of nf_tables change notifications (what `nft monitor` reads), for tests:
each message becomes a `Change`, decoded with the agent's own dump decoders
(agent/kernel/nftobjects.py, agent/kernel/nftrule.py). The agent itself only needs which
table and object a notification names (agent/kernel/view.py); tests use this to show what
the kernel sent, and that one code path decodes dumps and notifications alike."""
from __future__ import annotations

import struct
from typing import Any, Iterable, NamedTuple

from agent.kernel import nfnetlink as nl
from agent.kernel.nfnetlink import MalformedError, Message
from agent.kernel.nftobjects import Element, SetInfo, decode_chain, decode_set, elements_of
from agent.kernel.nftread import TABLE_OF_OBJECT, TableState
from agent.kernel.nftrule import decode_rule
from agent.kernel.nftuapi import (
    FAMILIES, FAMILY_NAMES, NFT_CHAIN_BINDING, NFT_MSG_DELCHAIN, NFT_MSG_DELRULE, NFT_MSG_DELSET, NFT_MSG_DELSETELEM,
    NFT_MSG_DELTABLE, NFT_MSG_NEWCHAIN, NFT_MSG_NEWGEN, NFT_MSG_NEWRULE, NFT_MSG_NEWSET, NFT_MSG_NEWSETELEM,
    NFT_MSG_NEWTABLE, NFTA_GEN_ID, NFTA_RULE_CHAIN, NFTA_SET_ELEM_LIST_ELEMENTS, NFTA_SET_ELEM_LIST_SET)

# What only notifications carry, by the names of linux/netfilter/nf_tables.h (as in agent/kernel/nftuapi.py)
NFT_MSG_NEWOBJ, NFT_MSG_DELOBJ, NFT_MSG_NEWFLOWTABLE, NFT_MSG_DELFLOWTABLE = 18, 20, 22, 24
NFTA_TABLE_HANDLE, NFTA_CHAIN_HANDLE, NFTA_RULE_HANDLE = 4, 2, 3
NFTA_GEN_PROC_PID, NFTA_GEN_PROC_NAME = 2, 3
NFTA_OBJ_NAME = 2  # enum nft_object_attributes
_KINDS = {NFT_MSG_NEWTABLE: ("table", "new"), NFT_MSG_DELTABLE: ("table", "del"),
          NFT_MSG_NEWCHAIN: ("chain", "new"), NFT_MSG_DELCHAIN: ("chain", "del"),
          NFT_MSG_NEWRULE: ("rule", "new"), NFT_MSG_DELRULE: ("rule", "del"),
          NFT_MSG_NEWSET: ("set", "new"), NFT_MSG_DELSET: ("set", "del"),
          NFT_MSG_NEWSETELEM: ("element", "new"), NFT_MSG_DELSETELEM: ("element", "del"),
          NFT_MSG_NEWGEN: ("gen", "new"), NFT_MSG_NEWOBJ: ("object", "new"), NFT_MSG_DELOBJ: ("object", "del"),
          NFT_MSG_NEWFLOWTABLE: ("flowtable", "new"), NFT_MSG_DELFLOWTABLE: ("flowtable", "del")}


class Change(NamedTuple):
    """One decoded notification."""

    kind: str  # table, chain, rule, set, element, gen, object, flowtable, other
    op: str  # new, del
    family: str
    table: str | None
    name: str | None  # the chain, set or object; a rule's chain; an element's set
    portid: int  # the committing socket's netlink port id
    obj: Any  # chain/set: declaration; rule: rule dict; element: list[Element];
    # gen: {"id", "pid", "comm"}; None when not decoded (an unknown set's elements)
    handle: int | None = None


class _Known:
    """What a Decoder knows of one table: its sets (anonymous ones with their elements)
    and its anonymous chains."""

    def __init__(self) -> None:
        self.sets: dict[str, SetInfo] = {}
        self.anon: dict[str, list[Element]] = {}
        self.bindings: set[str] = set()


class Decoder:
    """Decodes notifications with the same code as dumps. Knows the sets of the tables
    it was given (TableState.set_info) and learns sets (anonymous ones with their
    elements) from NFT_MSG_NEWSET/NFT_MSG_NEWSETELEM, so element notifications and rules
    with inline maps decode too. `tables` ((family, name) pairs) limits what it learns to those tables
    (default: the given states' tables if any, else every table)."""

    def __init__(self, *states: TableState, tables: Iterable[tuple[str, str]] | None = None) -> None:
        self._known: dict[tuple[int, str], _Known] = {}
        self._learn: set[tuple[int, str]] | None = (
            {(FAMILIES[f], t) for f, t in tables} if tables is not None else None)
        for st in states:
            for info in st.set_info.values():
                self._table(info.family, info.table, True).sets[info.name] = info
        if states and self._learn is None:
            self._learn = set(self._known)

    def _table(self, family: int, table: str, create: bool = False) -> _Known | None:
        known = self._known.get((family, table))
        if known is None and (create or self._learn is None or (family, table) in self._learn):
            known = self._known[(family, table)] = _Known()
        return known

    def decode(self, m: Message) -> Change:
        kind, op = _KINDS.get(m.msg, ("other", "new")) if m.subsys == nl.NFNL_SUBSYS_NFTABLES else ("other", "new")
        family = FAMILY_NAMES.get(m.family, str(m.family))
        try:
            a = m.attrs()
        except MalformedError:
            return Change(kind, op, family, None, None, m.portid, None)
        try:
            return self._decode(kind, op, family, m, a)
        except (MalformedError, KeyError, ValueError, struct.error, IndexError):
            table = nl.get_str(a[TABLE_OF_OBJECT]) if kind not in ("gen", "other") and TABLE_OF_OBJECT in a else None
            return Change(kind, op, family, table, None, m.portid, None)

    def _decode(self, kind: str, op: str, family: str, m: Message, a: dict[int, bytes]) -> Change:
        fam = m.family
        if kind == "gen":
            obj = {"id": nl.get_be32(a[NFTA_GEN_ID]),
                   "pid": nl.get_be32(a[NFTA_GEN_PROC_PID]) if NFTA_GEN_PROC_PID in a else None,
                   "comm": nl.get_str(a[NFTA_GEN_PROC_NAME]) if NFTA_GEN_PROC_NAME in a else None}
            return Change(kind, op, family, None, None, m.portid, obj)
        if kind == "other":
            return Change(kind, op, family, None, None, m.portid, None)
        table = nl.get_str(a[TABLE_OF_OBJECT])
        known = self._table(fam, table)
        if kind == "table":
            if op == "del":
                self._known.pop((fam, table), None)
            return Change(kind, op, family, table, table, m.portid, None,
                          nl.get_be64(a[NFTA_TABLE_HANDLE]) if NFTA_TABLE_HANDLE in a else None)
        if kind == "chain":
            name, decl, flags = decode_chain(a, fam)
            if flags & NFT_CHAIN_BINDING and known is not None:
                (known.bindings.add if op == "new" else known.bindings.discard)(name)
            return Change(kind, op, family, table, name, m.portid, decl,
                          nl.get_be64(a[NFTA_CHAIN_HANDLE]) if NFTA_CHAIN_HANDLE in a else None)
        if kind == "set":
            info = decode_set(a, fam)
            if known is not None and op == "new":
                known.sets[info.name] = info
            elif known is not None:
                known.sets.pop(info.name, None)
                known.anon.pop(info.name, None)
            return Change(kind, op, family, table, info.name, m.portid, info.decl, info.handle)
        if kind == "element":
            name = nl.get_str(a[NFTA_SET_ELEM_LIST_SET])
            info = known.sets.get(name) if known is not None else None
            found: list[Element] | None = None
            if info is not None and NFTA_SET_ELEM_LIST_ELEMENTS in a:
                found = elements_of([m], info)
                if info.anonymous and op == "new" and known is not None:
                    known.anon.setdefault(name, []).extend(found)
            return Change(kind, op, family, table, name, m.portid, found)
        if kind == "rule":
            chain = nl.get_str(a[NFTA_RULE_CHAIN])
            k = known or _Known()
            return Change(kind, op, family, table, chain, m.portid, decode_rule(a, fam, k.sets, k.anon, k.bindings),
                          nl.get_be64(a[NFTA_RULE_HANDLE]) if NFTA_RULE_HANDLE in a else None)
        name = nl.get_str(a[NFTA_OBJ_NAME]) if NFTA_OBJ_NAME in a else None  # NFTA_FLOWTABLE_NAME is 2 too
        return Change(kind, op, family, table, name, m.portid, None)
