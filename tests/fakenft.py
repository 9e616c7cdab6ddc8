"""A fake of libnftables that holds tables, in the spirit of knftables' Fake.

It applies JSON commands (and the agent's closed vocabulary of nft text declarations)
transactionally to in-memory tables: all or nothing, with the kernel's errors for missing,
existing and busy objects (as measured against the kernel: see the cases in
tests/test_fakenft.py); answers listings in the form nft 1.0.6 gives; counts a generation
that moves with every committed transaction; can be told to refuse the next ones; and
`trace()` says where a packet would go (kube-proxy's tracePacket idea), for the agent's
rule vocabulary.

Unit tests drive the agent's real Nft edge with it: drift, repair, redeclaration and
chain retirement need no root."""
from __future__ import annotations

import contextlib
import copy
import json
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

ENOENT = "Error: Could not process rule: No such file or directory"
EEXIST = "Error: Could not process rule: File exists"
EBUSY = "Error: Could not process rule: Device or resource busy"
EOPNOTSUPP = "Error: Could not process rule: Operation not supported"

ElemKey = tuple[Any, ...]


class Refused(Exception):
    """The kernel (or nft's parser) refuses the transaction."""


@dataclass
class _Elem:
    value: Any = None  # map data; None for a set's element
    comment: str | None = None
    counter: tuple[int, int] | None = None  # (packets, bytes) when the set counts per element
    timeout: int | None = None  # a dynamic entry's timeout (seconds)


@dataclass
class _Set:
    handle: int
    decl: dict[str, Any]  # type, map, flags, size, stmt: as listed
    elems: dict[ElemKey, _Elem] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "map" if "map" in self.decl else "set"


@dataclass
class _Chain:
    handle: int
    decl: dict[str, Any]  # type, hook, prio, policy for a base chain; {} for a regular one
    rules: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (handle, rule)


@dataclass
class _Table:
    handle: int
    sets: dict[str, _Set] = field(default_factory=dict)
    chains: dict[str, _Chain] = field(default_factory=dict)
    next_handle: int = 1

    def handle_for(self) -> int:
        self.next_handle += 1
        return self.next_handle - 1


_SET_FIELDS = ("type", "map", "flags", "size", "stmt")
_CHAIN_FIELDS = ("type", "hook", "prio", "policy")


class FakeNft:
    """Stands in for the agent's libnftables context (json_cmd, cmd, dry_run), holding
    tables. `version` "1.0.6" or "1.1.3" picks the JSON parser's known differences: a map
    with concatenated data declared as a list (1.0.6 silently makes a plain set of it,
    1.1.3 the map) and the `destroy` verb (1.1.3 only). Every committed command is noted
    with who sent it, for the view's change notifications (view())."""

    def __init__(self, version: str = "1.0.6") -> None:
        self.version = version
        self.tables: dict[tuple[str, str], _Table] = {}
        self.events: list[tuple[str, str, str, str, str | None]] = []  # (origin, family, table, kind, name)
        self._origin = "agent"
        self._noted: list[tuple[str, str, str, str, str | None]] = []
        self._generation = 0
        self.batches: list[list[dict[str, Any]]] = []  # committed JSON transactions
        self.texts: list[str] = []  # committed text transactions
        self.refusals: list[str] = []  # the error of every refused transaction
        self.listings = 0  # list commands answered
        self._failures: deque[str] = deque()
        # Refuse any JSON transaction for which this returns an error message.
        self.refuse_if: Callable[[list[dict[str, Any]]], str | None] = lambda commands: None

    # -- what the agent calls ------------------------------------------------------

    def generation(self) -> int:
        return self._generation

    def json_cmd(self, doc: dict[str, Any]) -> tuple[int, Any, str]:
        commands = doc["nftables"]
        if commands and all("list" in c for c in commands) and "tables" in commands[0]["list"]:
            return 0, {"nftables": [self._metainfo(), *({"table": {"family": f, "name": n, "handle": t.handle}}
                                                        for (f, n), t in self.tables.items())]}, ""
        if commands and all("list" in c for c in commands):
            self.listings += 1
            try:
                return 0, {"nftables": [self._metainfo(), *[i for c in commands for i in self._list(c["list"])]]}, ""
            except Refused as err:
                return 1, "", str(err)
        if any("list" in c for c in commands):
            raise AssertionError(f"the fake does not mix listings and changes: {commands!r}")
        if (message := self.refuse_if(commands)) is not None:
            self.refusals.append(message)
            return 1, "", message
        return self._transaction(lambda tables: [self._command(tables, c) for c in commands],
                                 lambda: self.batches.append(copy.deepcopy(commands)))

    def dry_run(self, doc: dict[str, Any]) -> int:
        """What the transaction would answer, committing nothing."""
        tables = copy.deepcopy(self.tables)
        try:
            for command in doc["nftables"]:
                self._command(tables, command)
        except Refused:
            return 1
        finally:
            self._noted = []
        return 0

    def view(self, family: str = "ip", table: str = "natgw", also: tuple[str, ...] = ()) -> FakeView:
        return FakeView(self, family, table, also)

    def cmd(self, text: str) -> tuple[int, Any, str]:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return self._transaction(lambda tables: [self._text(tables, line) for line in lines],
                                 lambda: self.texts.append(text))

    # -- what tests call -----------------------------------------------------------

    def fail_next(self, count: int = 1, message: str = "Error: Could not process rule: injected fault") -> None:
        """Refuse the next `count` transactions (listings still answer)."""
        self._failures.extend([message] * count)

    def external(self, change: list[dict[str, Any]] | str) -> None:
        """Someone else's transaction, JSON commands or nft text (another process: the
        agent did not send it, and it is not recorded among the agent's)."""
        self._origin = "other"
        try:
            if isinstance(change, str):
                rc, _, err = self.cmd(change)
                assert rc == 0, err
                self.texts.pop()
            else:
                rc, _, err = self.json_cmd({"nftables": change})
                assert rc == 0, err
                self.batches.pop()
        finally:
            self._origin = "agent"

    def pin(self, table: str, set_name: str, key: ElemKey, timeout: int = 600) -> None:
        """A packet's `update` filling a dynamic set: no transaction, no generation."""
        self.tables[("ip", table)].sets[set_name].elems[tuple(key)] = _Elem(timeout=timeout)

    def entries(self, table: str, set_name: str) -> set[ElemKey]:
        return set(self.tables[("ip", table)].sets[set_name].elems)

    def dump(self, family: str = "ip", table: str = "natgw") -> str:
        """The table as sorted JSON lines without handles ("" if there is none):
        deterministic, for asserts."""
        rc, doc, _ = self.json_cmd({"nftables": [{"list": {"table": {"family": family, "name": table}}}]})
        self.listings -= 1
        if rc != 0:
            return ""  # no such table
        lines = []
        for item in doc["nftables"][1:]:
            kind, body = next(iter(item.items()))
            body = {k: v for k, v in body.items() if k != "handle"}
            if "elem" in body:
                body["elem"] = sorted(body["elem"], key=lambda e: json.dumps(e, sort_keys=True))
            lines.append(json.dumps({kind: body}, sort_keys=True))
        return "\n".join(sorted(lines))

    # -- transactions ----------------------------------------------------------------

    def _transaction(self, body: Callable[[dict[tuple[str, str], _Table]], Any],
                     record: Callable[[], None]) -> tuple[int, Any, str]:
        if self._failures:
            message = self._failures.popleft()
            self.refusals.append(message)
            return 1, "", message
        tables = copy.deepcopy(self.tables)
        self._noted: list[tuple[str, str, str, str, str | None]] = []
        try:
            body(tables)
        except Refused as err:
            self.refusals.append(str(err))
            return 1, "", str(err)
        self.tables = tables
        self._generation += 1
        self.events.extend(self._noted)
        record()
        return 0, "", ""

    def _note(self, family: str, table: str, kind: str, name: str | None = None) -> None:
        self._noted.append((self._origin, family, table, kind, name))

    def _command(self, tables: dict[tuple[str, str], _Table], command: dict[str, Any]) -> None:
        (verb, what), = command.items()
        (kind, body), = what.items()
        kind = "set" if kind == "map" else kind
        if verb == "destroy":
            if self.version < "1.0.8":
                raise Refused("Error: Unknown object passed to add command.")  # 1.0.6's parser
            try:
                getattr(self, f"_delete_{kind}")(tables, body)
            except Refused as err:
                if str(err) != ENOENT:
                    raise
            return
        getattr(self, f"_{verb}_{kind}")(tables, body)
        table = body.get("table", body.get("name")) if kind != "table" else body["name"]
        name = {"table": None, "chain": body.get("name"), "rule": body.get("chain"), "set": body.get("name"),
                "element": body.get("name")}[kind]
        self._note(body["family"], table, kind, name)

    @staticmethod
    def _table(tables: dict[tuple[str, str], _Table], body: dict[str, Any], key: str = "table") -> _Table:
        table = tables.get((body["family"], body[key]))
        if table is None:
            raise Refused(ENOENT)
        return table

    def _add_table(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        tables.setdefault((body["family"], body["name"]), _Table(len(tables) + 1))

    def _delete_table(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        self._table(tables, body, "name")
        del tables[(body["family"], body["name"])]

    def _flush_table(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        for chain in self._table(tables, body, "name").chains.values():
            chain.rules.clear()  # rules only: sets keep their elements (as the kernel does)

    def _add_chain(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        table = self._table(tables, body)
        decl = {k: body[k] for k in _CHAIN_FIELDS if k in body}
        chain = table.chains.get(body["name"])
        if chain is None:
            table.chains[body["name"]] = _Chain(table.handle_for(), decl)
        elif decl and chain.decl != decl:
            raise Refused(EOPNOTSUPP)  # a base chain's hook or priority cannot change in place

    def _delete_chain(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        table = self._table(tables, body)
        if body["name"] not in table.chains:
            raise Refused(ENOENT)
        if _chain_referenced(table, body["name"]):
            raise Refused(EBUSY)
        del table.chains[body["name"]]  # with its rules

    def _flush_chain(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        chain = self._table(tables, body).chains.get(body["name"])
        if chain is None:
            raise Refused(ENOENT)
        chain.rules.clear()

    def _add_rule(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        table = self._table(tables, body)
        chain = table.chains.get(body["chain"])
        if chain is None:
            raise Refused(ENOENT)
        text = json.dumps(body["expr"])
        if any(name not in table.sets for name in re.findall(r'"@([^"]+)"', text)):
            raise Refused(ENOENT)
        if any(target not in table.chains for target in _targets(body["expr"])):
            raise Refused(ENOENT)
        rule = {"expr": copy.deepcopy(body["expr"]), **({"comment": body["comment"]} if "comment" in body else {})}
        chain.rules.append((table.handle_for(), rule))

    def _add_set(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        table = self._table(tables, body)
        if " . " in str(body.get("map", "")):
            raise Refused("Error: Invalid map type")  # the form 1.0.6 lists; no version's JSON takes it
        if isinstance(body.get("map"), list):
            body = dict(body)
            if self.version < "1.1.0":
                del body["map"]  # 1.0.6 silently makes a plain set of it (measured)
            else:
                body["map"] = " . ".join(body["map"])  # a map; the canonical form, as the view gives it
        if "dynamic" in body.get("flags", []) and self.version < "1.0.9":
            raise Refused("Error: Invalid set flag")  # nft 1.0.6's JSON parser
        decl = {k: copy.deepcopy(body[k]) for k in _SET_FIELDS if k in body}
        existing = table.sets.get(body["name"])
        if existing is None:
            table.sets[body["name"]] = _Set(table.handle_for(), decl)
        elif existing.decl != decl:
            raise Refused(EEXIST)

    def _delete_set(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        table = self._table(tables, body)
        if body["name"] not in table.sets:
            raise Refused(ENOENT)
        if any(f'"@{body["name"]}"' in json.dumps(rule) for c in table.chains.values() for _, rule in c.rules):
            raise Refused(EBUSY)
        del table.sets[body["name"]]

    def _add_element(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        table = self._table(tables, body)
        target = table.sets.get(body["name"])
        if target is None:
            raise Refused(ENOENT)
        counting = {"counter": None} in target.decl.get("stmt", [])
        for item in body["elem"]:
            raw, value = (item[0], item[1]) if target.kind == "map" else (item, None)
            key, comment, timeout = _parse_key(raw)
            if isinstance(value, dict) and "goto" in value and value["goto"]["target"] not in table.chains:
                raise Refused(ENOENT)
            old = target.elems.get(key)
            if old is not None and old.value != value:
                raise Refused(EEXIST)  # the same key with other data (in the table or in this batch)
            if old is None:
                target.elems[key] = _Elem(copy.deepcopy(value), comment, (0, 0) if counting else None, timeout)

    def _delete_element(self, tables: dict[tuple[str, str], _Table], body: dict[str, Any]) -> None:
        table = self._table(tables, body)
        target = table.sets.get(body["name"])
        if target is None:
            raise Refused(ENOENT)
        for raw in body["elem"]:
            key = _parse_key(raw)[0]
            if key not in target.elems:
                raise Refused(ENOENT)
            del target.elems[key]

    # -- the agent's text vocabulary (agent/kernel/nft.py text_declaration) ------------------

    _TEXT_TABLE = re.compile(r"add table (\w+) (\w+)")
    _TEXT_MAP = re.compile(r"add map (\w+) (\w+) (\w+) \{ type ([\w .]+) : ([\w .]+);( counter;)? \}")

    def _text(self, tables: dict[tuple[str, str], _Table], line: str) -> None:
        if m := self._TEXT_TABLE.fullmatch(line):
            self._add_table(tables, {"family": m[1], "name": m[2]})
        elif m := self._TEXT_MAP.fullmatch(line):
            table = self._table(tables, {"family": m[1], "table": m[2]})
            decl: dict[str, Any] = {"type": m[4].split(" . "), "map": m[5]}  # listed as a string, like 1.0.6
            if m[6]:
                decl["stmt"] = [{"counter": None}]
            existing = table.sets.get(m[3])
            if existing is None:
                table.sets[m[3]] = _Set(table.handle_for(), decl)
            elif existing.decl != decl:
                raise Refused(EEXIST)
        else:
            raise AssertionError(f"nft text outside the agent's vocabulary: {line!r}")

    # -- listings --------------------------------------------------------------------

    def _metainfo(self) -> dict[str, Any]:
        return {"metainfo": {"version": self.version, "release_name": "fake", "json_schema_version": 1}}

    def _list(self, what: dict[str, Any]) -> list[dict[str, Any]]:
        (kind, body), = what.items()
        if kind == "table":
            table = self._table(self.tables, body, "name")
            items: list[dict[str, Any]] = [{"table": {"family": body["family"], "name": body["name"], "handle": table.handle}}]
            items += [self._set_item(body["family"], body["name"], n, s)
                      for n, s in sorted(table.sets.items(), key=lambda kv: kv[1].handle)]
            chains = sorted(table.chains.items(), key=lambda kv: kv[1].handle)
            items += [{"chain": {"family": body["family"], "table": body["name"], "name": n, "handle": c.handle, **c.decl}}
                      for n, c in chains]
            items += [{"rule": {"family": body["family"], "table": body["name"], "chain": n, "handle": h, **rule}}
                      for n, c in chains for h, rule in c.rules]
            return items
        if kind in ("set", "map"):
            target = self._table(self.tables, body).sets.get(body["name"])
            if target is None:
                raise Refused(ENOENT)
            return [self._set_item(body["family"], body["table"], body["name"], target)]
        raise AssertionError(f"listing the fake does not answer: {what!r}")

    @staticmethod
    def _set_item(family: str, table: str, name: str, target: _Set) -> dict[str, Any]:
        body: dict[str, Any] = {"family": family, "name": name, "table": table, "type": target.decl["type"],
                                "handle": target.handle}
        for k in ("map", "size", "flags"):
            if k in target.decl:
                body[k] = target.decl[k]
        elems = []
        for key, elem in target.elems.items():
            val = {"concat": list(key)} if len(key) > 1 else key[0]
            extra = {k: v for k, v in (("comment", elem.comment), ("timeout", elem.timeout)) if v is not None}
            if elem.timeout is not None:
                extra["expires"] = elem.timeout - 1
            if elem.counter is not None:
                extra["counter"] = {"packets": elem.counter[0], "bytes": elem.counter[1]}
            listed = {"elem": {"val": val, **extra}} if extra else val
            elems.append([listed, elem.value] if target.kind == "map" else listed)
        if elems:
            body["elem"] = elems
        if "stmt" in target.decl:
            body["stmt"] = target.decl["stmt"]
        return {target.kind: body}

    # -- where a packet goes -----------------------------------------------------------

    def trace(self, saddr: str, daddr: str, proto: str, dport: int, pick: Callable[[int], int] = lambda mod: 0,
              family: str = "ip", table: str = "natgw", iif: str = "net1",
              packet: dict[str, Any] | None = None) -> tuple[str, int] | None:
        """The backend (address, port) a new connection's first packet, arriving on `iif`,
        is DNATed to, or None if it leaves without NAT. `pick(mod)` plays numgen random;
        affinity sets are read and updated as the kernel would; `packet`, if given, is
        filled with the packet's fields as prerouting leaves them (its mark, and its
        connection's as "ct mark"). Only the agent's vocabulary is understood."""
        t = self.tables[(family, table)]
        fields = {"saddr": saddr, "daddr": daddr, "l4proto": proto, "dport": dport, "iifname": iif, "mark": 0,
                  "ct mark": 0}
        if packet is not None:
            packet.update(fields)
            fields = packet
        base = [n for n, c in t.chains.items() if c.decl.get("hook") == "prerouting"]
        for name in base:
            result = _run_chain(t, name, fields, pick)
            if result is not None:
                return result
        return None


def _chain_referenced(table: _Table, name: str) -> bool:
    for chain in table.chains.values():
        if any(name in _targets(rule["expr"]) for _, rule in chain.rules):
            return True
    return any(isinstance(e.value, dict) and e.value.get("goto", {}).get("target") == name
               for s in table.sets.values() for e in s.elems.values())


def _targets(expr: Any) -> Iterable[str]:
    """Chains a rule's expressions jump or go to (inline vmaps included)."""
    if isinstance(expr, dict):
        for verdict in ("goto", "jump"):
            if verdict in expr and isinstance(expr[verdict], dict) and "target" in expr[verdict]:
                yield expr[verdict]["target"]
        for value in expr.values():
            yield from _targets(value)
    elif isinstance(expr, list):
        for value in expr:
            yield from _targets(value)


def _parse_key(raw: Any) -> tuple[ElemKey, str | None, int | None]:
    comment = timeout = None
    if isinstance(raw, dict) and "elem" in raw:
        comment, timeout = raw["elem"].get("comment"), raw["elem"].get("timeout")
        raw = raw["elem"]["val"]
    key = tuple(raw["concat"]) if isinstance(raw, dict) and "concat" in raw else (raw,)
    return key, comment, timeout


def _field(expr: dict[str, Any]) -> str:
    """The trace's name for a meta key ("mark") or a conntrack one ("ct mark")."""
    return expr["meta"]["key"] if "meta" in expr else f"ct {expr['ct']['key']}"


def _value(expr: dict[str, Any], fields: dict[str, Any]) -> Any:
    if "jhash" in expr:  # the kernel's hash, as the agent's model computes it (checked against the kernel)
        from agent.core.consistent import bucket

        h = expr["jhash"]
        return bucket(_value(h["expr"], fields), h["mod"], h["seed"], h.get("offset", 0))
    if "concat" in expr:
        return tuple(_value(e, fields) for e in expr["concat"])
    if "payload" in expr:
        return fields[expr["payload"]["field"]]
    if "meta" in expr or "ct" in expr:
        return fields[_field(expr)]
    if "&" in expr:
        return _value(expr["&"][0], fields) & expr["&"][1]
    if "|" in expr:
        return _value(expr["|"][0], fields) | expr["|"][1]
    raise AssertionError(f"trace: expression outside the vocabulary: {expr!r}")


def _run_chain(t: _Table, name: str, fields: dict[str, Any], pick: Callable[[int], int]) -> tuple[str, int] | None:
    for _, rule in t.chains[name].rules:
        verdict: str | None = None
        for stmt in rule["expr"]:
            if "vmap" in stmt:
                key, data = stmt["vmap"]["key"], stmt["vmap"]["data"]
                if "numgen" in key:
                    chosen = pick(key["numgen"]["mod"]) + key["numgen"]["offset"]
                    target = dict(data["set"]).get(chosen)
                elif isinstance(data, dict):  # an anonymous map
                    target = dict(data["set"]).get(_value(key, fields))
                else:
                    elem = t.sets[data.removeprefix("@")].elems.get(_value(key, fields))
                    target = elem.value if elem is not None else None
                if target is None:
                    break  # no element: the rule does not match
                return _run_chain(t, target["goto"]["target"], fields, pick)
            if "match" in stmt:
                left, right = _value(stmt["match"]["left"], fields), stmt["match"]["right"]
                if isinstance(right, str) and right.startswith("@"):
                    if left not in t.sets[right.removeprefix("@")].elems:
                        break
                elif left != right:
                    break
            elif "mangle" in stmt:
                fields[_field(stmt["mangle"]["key"])] = _value(stmt["mangle"]["value"], fields)
            elif "goto" in stmt:
                verdict = stmt["goto"]["target"]
            elif "jump" in stmt:  # and back here, unless the chain jumped to decides
                result = _run_chain(t, stmt["jump"]["target"], fields, pick)
                if result is not None:
                    return result
            elif "set" in stmt and stmt["set"]["op"] == "update":
                elem = stmt["set"]["elem"]["elem"]
                target = t.sets[stmt["set"]["set"].removeprefix("@")]
                target.elems[_value(elem["val"], fields)] = _Elem(timeout=elem.get("timeout"))
            elif "dnat" in stmt:
                mapping = stmt["dnat"]["addr"]["map"]
                elem = t.sets[mapping["data"].removeprefix("@")].elems.get(_value(mapping["key"], fields))
                if elem is None:
                    break  # no backend in this slot: the packet goes on, not NATed
                if elem.counter is not None:
                    elem.counter = (elem.counter[0] + 1, elem.counter[1] + 60)
                addr, port = elem.value["concat"]
                return addr, port
            else:
                raise AssertionError(f"trace: statement outside the vocabulary: {stmt!r}")
        if verdict is not None:
            return _run_chain(t, verdict, fields, pick)
    return None


class FakeView:
    """The fake's tables as the agent's kernel view (agent/kernel/view.py's KernelView): reads
    in the canonical forms, and change notifications of what others committed."""

    def __init__(self, fake: FakeNft, family: str, table: str, also: tuple[str, ...]) -> None:
        self.fake, self.family, self.table, self.also = fake, family, table, also
        self._seen = len(fake.events)
        self._lost = False  # others committed while deaf(): the next damage() is everything
        self._unheard: list[range] = []  # event indices committed while deaf()
        self.deaf_windows = 0
        self.reads = 0
        self.state = None

    def fileno(self) -> int | None:
        return None  # nothing to sleep on: the loop asks damage() every turn

    def keep_up(self) -> None:
        pass  # the fake's events do not pile up anywhere

    def missed(self) -> bool:
        return self._lost

    @contextlib.contextmanager
    def deaf(self, commits: Any) -> Iterator[None]:
        """As the kernel view's: what others commit meanwhile is not heard, only known of."""
        self.deaf_windows += 1
        start = len(self.fake.events)
        try:
            yield
        finally:
            window = range(start, len(self.fake.events))
            self._unheard.append(window)
            self._lost = self._lost or any(self.fake.events[i][0] != "agent" for i in window)

    def read(self) -> Any:
        self.reads += 1
        self._seen, self._unheard, self._lost = len(self.fake.events), [], False  # superseded by the read
        return self.read_other(self.table)

    def read_other(self, table: str) -> Any:
        from tests.oracles import from_listing

        rc, doc, _ = self.fake.json_cmd({"nftables": [{"list": {"table": {"family": self.family, "name": table}}}]})
        self.fake.listings -= 1
        return from_listing(doc) if rc == 0 else None

    def damage(self) -> Any:
        from agent.kernel.view import Damage
        from agent.core.layout import affinity_slot

        events = [e for i, e in enumerate(self.fake.events) if i >= self._seen and not any(i in w for w in self._unheard)]
        self._seen, self._unheard = len(self.fake.events), []
        chains, sets, elements, others, everything = set(), set(), set(), set(), self._lost
        self._lost = False
        for origin, family, table, kind, name in events:
            if origin == "agent" or family != self.family or (table != self.table and table not in self.also):
                continue
            if table != self.table:
                others.add(table)
            elif kind == "table":
                everything = True
            elif kind in ("chain", "rule"):
                chains.add(name)
            elif kind == "set":
                sets.add(name)
            elif affinity_slot(name) is None:
                elements.add(name)
        return Damage(everything, frozenset(chains), frozenset(sets), frozenset(elements), frozenset(others))

    def reread(self, damage: Any, mirror: Any) -> Any:
        from agent.kernel.view import reread
        from agent.core.ruleset import Ruleset, holds

        def head() -> Any:
            full = self.read_other(self.table)
            return None if full is None else Ruleset(full.sets, full.chains, full.rules, {})

        def elements(name: str) -> Any:
            full = self.read_other(self.table)
            return None if full is None or not holds(name, full.sets) else full.elements.get(name, {})

        self.reads += 1
        return reread(damage, mirror, head, elements)

    def entries(self, name: str) -> list[ElemKey]:
        table = self.fake.tables.get((self.family, self.table))
        return list(table.sets[name].elems) if table is not None and name in table.sets else []

    def declaration(self, name: str) -> dict[str, Any] | None:
        table = self.fake.tables.get((self.family, self.table))
        return copy.deepcopy(table.sets[name].decl) if table is not None and name in table.sets else None


def edges(fake: FakeNft, family: str = "ip", table: str = "natgw") -> tuple[Any, FakeView]:
    """The agent's two edges on a fake: its writer (agent.kernel.nft.Nft) and its kernel view."""
    from agent.kernel.nft import Nft

    return Nft(family, table, fake), fake.view(family, table)


def wired(settings: Any, nft: Any, view: Any, caps: Any = None, flow_table: Any = None) -> Any:
    """A reconciler on these edges, wired as the daemon wires one (agent/run/daemon.py's
    assemble): its cleanup thread reads the affinity sets through `view`, and conntrack
    only through `flow_table` (a maker of a fake one) when given; `caps` unprobed if None."""
    from agent.kernel.caps import UNPROBED
    from agent.ops.report import Reporter
    from agent.run.daemon import assemble

    return assemble(settings, nft, view, UNPROBED if caps is None else caps, Reporter(), flow_table, lambda: view)
