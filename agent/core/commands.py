"""nftables commands, each built by a small constructor that checks what it puts in
(knftables' typed operations): the writers (the planner, the legacy takeover, the
capability probe, cleanup) never write a command dict by hand. A command is the plain
libnftables JSON dict, its keys in the order golden files and digests have always seen.
Pure: no I/O.

Names are checked by verb. A name the agent creates or adds to must be one nft's own
grammar takes unquoted, so `nft list` shows it as written. A name it deletes or flushes
may be anything the kernel holds: someone else's object in the agent's table is read
back and removed whatever its name (libnftables' JSON and the kernel take "a b", even "";
seen on nft 1.0.6), so the check there is the kernel's own (a string of at most 255
bytes)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

Command = dict[str, Any]

# What the agent writes in nft text (its table's name, the maps declared in text): names
# it generates itself, from the narrowest vocabulary.
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

# nft's grammar for an unquoted name (its scanner's `string`: on nft 1.0.6 "a-b.c/d" and
# ".x" are names, "9a", "-a" and "x\y" are refused), at most 255 bytes: the kernel's
# NFT_NAME_MAXLEN is 256 with the NUL (a 256-byte table name is refused with ERANGE).
NAME = re.compile(r"[A-Za-z_.][A-Za-z0-9/_.-]{0,254}")
_MAX_BYTES = 255

FAMILIES = frozenset({"ip", "ip6", "inet", "arp", "bridge", "netdev"})
_OWN_KEYS = frozenset({"family", "table", "name", "chain"})  # what a constructor writes itself


class CommandError(ValueError):
    """A command that cannot be built, with the verb, the object and the reason named."""

    def __init__(self, verb: str, kind: str, name: Any, reason: str) -> None:
        self.verb = verb
        self.kind = kind
        self.name = name
        self.reason = reason
        super().__init__(f"cannot {verb} {kind} {name!r}: {reason}")


def set_kind(decl: Mapping[str, Any]) -> str:
    """"map" or "set": a declaration with data ("map") is a map."""
    return "map" if "map" in decl else "set"


def _new(verb: str, kind: str, name: Any) -> str:
    """A name the agent creates or adds to."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise CommandError(verb, kind, name, "not an nft name (a letter, _ or . first; then letters, digits, "
                                             "/ - _ .; at most 255)")
    return name


def _held(verb: str, kind: str, name: Any) -> str:
    """A name the kernel may hold, read back: to delete or flush."""
    if not isinstance(name, str) or "\0" in name or len(name.encode()) > _MAX_BYTES:
        raise CommandError(verb, kind, name, "not a name the kernel holds (a string of at most 255 bytes, no NUL)")
    return name


def _body(verb: str, kind: str, name: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """A declaration or rule to spread into a command: it may not carry the keys the
    constructor writes (one would silently replace the checked name)."""
    if not _OWN_KEYS.isdisjoint(body):
        raise CommandError(verb, kind, name, f"carries {sorted(_OWN_KEYS.intersection(body))}")
    return body


@dataclass(frozen=True)
class Table:
    """One table, and the commands on it and on what it holds."""

    family: str
    name: str

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise CommandError("use", "table", self.name, f"unknown family {self.family!r}")
        _new("use", "table", self.name)

    def add(self) -> Command:
        return {"add": {"table": {"family": self.family, "name": self.name}}}

    def delete(self) -> Command:
        return {"delete": {"table": {"family": self.family, "name": self.name}}}

    def flush(self) -> Command:
        return {"flush": {"table": {"family": self.family, "name": self.name}}}

    def destroy(self) -> Command:
        """A delete that fails nothing when the table is gone (nft >= 1.0.8, kernel >= 6.3)."""
        return {"destroy": {"table": {"family": self.family, "name": self.name}}}

    def add_chain(self, name: str, decl: Mapping[str, Any]) -> Command:
        _new("add", "chain", name)
        return {"add": {"chain": {"family": self.family, "table": self.name, "name": name,
                                  **_body("add", "chain", name, decl)}}}

    def flush_chain(self, name: str) -> Command:
        return {"flush": {"chain": self._ref("flush", "chain", name)}}

    def delete_chain(self, name: str) -> Command:
        return {"delete": {"chain": self._ref("delete", "chain", name)}}

    def add_set(self, name: str, decl: Mapping[str, Any]) -> Command:
        """A set, or a map if the declaration has data."""
        kind = set_kind(decl)
        _new("add", kind, name)
        if "type" not in decl:
            raise CommandError("add", kind, name, "declaration without a type")
        return {"add": {kind: {"family": self.family, "table": self.name, "name": name,
                               **_body("add", kind, name, decl)}}}

    def delete_set(self, name: str, decl: Mapping[str, Any]) -> Command:
        """Delete a set, or a map if its declaration has data."""
        kind = set_kind(decl)
        return {"delete": {kind: self._ref("delete", kind, name)}}

    def add_rule(self, chain: str, rule: Mapping[str, Any]) -> Command:
        _new("add", "rule to chain", chain)
        if "expr" not in rule:
            raise CommandError("add", "rule to chain", chain, "rule without expressions")
        return {"add": {"rule": {"family": self.family, "table": self.name, "chain": chain,
                                 **_body("add", "rule to chain", chain, rule)}}}

    def add_elements(self, name: str, elems: Iterable[Any]) -> Command:
        """Elements into a set or map: keys, or [key, data] pairs for a map."""
        _new("add", "elements to", name)
        return {"add": {"element": {"family": self.family, "table": self.name, "name": name, "elem": list(elems)}}}

    def delete_elements(self, name: str, keys: Iterable[Any]) -> Command:
        return {"delete": {"element": {**self._ref("delete", "elements from", name), "elem": list(keys)}}}

    def destroy_elements(self, name: str, keys: Iterable[Any]) -> Command:
        """A delete that fails nothing on an element already gone (an expired entry)."""
        return {"destroy": {"element": {**self._ref("destroy", "elements from", name), "elem": list(keys)}}}

    def _ref(self, verb: str, kind: str, name: str) -> dict[str, Any]:
        return {"family": self.family, "table": self.name, "name": _held(verb, kind, name)}
