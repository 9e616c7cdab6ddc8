"""Plan: the difference between what the kernel holds and the desired ruleset, as
libnftables JSON commands (built by agent/core/commands.py), and the phases they are sent
in (one atomic transaction each; one, unless maps must be declared in nft text first).
Pure: no I/O.

Order inside the transaction: declare what is new; rewrite changed chains; swap map
elements; empty the chains and delete the sets nothing points to any more. Emptied chains
are deleted by a later transaction (retire)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

from agent.core.commands import Command, Table
from agent.core.ruleset import EMPTY, Buckets, ElemKey, Ruleset, bucket_map, concat_data, data_json, key_json

PREPARE = "prepare"  # deletes that must commit before a declaration in text: the data plane changes
DECLARE = "declare"  # maps declared in nft text: empty and unreferenced until the main phase commits
PART = "part"  # one of several transactions of a plan that only adds, each with whole identities
MAIN = "main"


@dataclass(frozen=True)
class Phase:
    kind: str  # PREPARE, DECLARE (the nft edge writes these commands as nft text) or MAIN
    commands: tuple[Command, ...]


@dataclass(frozen=True)
class Plan:
    """A change: its commands in their logical order (what `render` and `diff` print) and
    the phases the nft edge sends them in, one transaction each, in order."""

    commands: tuple[Command, ...]
    phases: tuple[Phase, ...]

    def __bool__(self) -> bool:
        return bool(self.commands)

    def __len__(self) -> int:
        return len(self.commands)

    def then(self, commands: Sequence[Command]) -> Plan:
        """This plan with more commands at the end of its main transaction."""
        if not commands:
            return self
        phases = list(self.phases)
        if phases and phases[-1].kind == MAIN:
            phases[-1] = Phase(MAIN, (*phases[-1].commands, *commands))
        else:
            phases.append(Phase(MAIN, tuple(commands)))
        return Plan((*self.commands, *commands), tuple(phases))


def one_transaction(commands: Iterable[Command]) -> Plan:
    commands = tuple(commands)
    return Plan(commands, (Phase(MAIN, commands),) if commands else ())


def plan(current: Ruleset | None, desired: Ruleset, family: str, table: str, text_maps: bool = True) -> Plan:
    """The change that turns `current` (None: the table does not exist) into `desired`.

    An unchanged ruleset yields no command at all. A changed declaration (a set's type or
    size, the base chain's priority: an upgrade or a settings change) cannot be altered in
    place: see _redeclare(). `text_maps`: this libnftables cannot declare maps with
    concatenated data in JSON (nft 1.0.6; agent/kernel/caps.py finds out), so they go first, in
    nft text; else everything is one JSON transaction.
    """
    commands = _commands(current, desired, family, table)
    if text_maps:
        return phased(commands, family, table)
    # In the order the text path sends them (its phases, one after the other), so the
    # kernel holds and lists the table alike however the maps were declared.
    ordered = [c for phase in phased(commands, family, table).phases for c in phase.commands]
    add_table = Table(family, table).add()
    ordered = [c for i, c in enumerate(ordered) if c != add_table or add_table not in ordered[:i]]
    return one_transaction([_json_form(c) if needs_text(c) else c for c in ordered])


def chunked(todo: Plan, max_elements: int, last: Collection[str] = ()) -> Plan:
    """A plan that only adds (a table programmed from empty, or many new identities) with
    more than `max_elements` map elements, sent as several transactions: the first with
    every declaration, chain and rule and the first identities' elements, each next one
    with more identities' elements, never part of an identity's (its services element and
    its backends go together, so an identity is served whole or not at all). Why: while it
    works libnftables holds ~2.7 KB per element (135 MB for 50,000, measured), which a
    gateway's memory should not pay at once. Any plan that deletes or flushes stays one
    transaction.

    The rules of the chains named in `last` go in the last transaction: the agent names
    the chain that makes the chash maps reachable, so that the kernel's validation of the
    jump graph at each commit (~0.1 us per reachable verdict element, layout.py) walks their
    elements once, not once per part (10,000 ClientIP identities: 610,000 elements, 66
    parts); until then a new client's backend is numgen's, on a replica not Ready yet."""
    if not todo.phases or todo.phases[-1].kind != MAIN:
        return todo
    main = todo.phases[-1].commands
    if any(verb != "add" for c in main for verb in c) or element_count(main) <= max_elements:
        return todo
    head = [c for c in main if "element" not in c.get("add", {}) and c["add"].get("rule", {}).get("chain") not in last]
    tail = [c for c in main if c["add"].get("rule", {}).get("chain") in last]
    # Two passes and no object per entry (a (command, entry) pair each cost ~45 MB at
    # 10,000 ClientIP identities' 660,000 elements): the identities' sizes, in order of
    # first appearance, decide the parts; then each entry goes to its identity's part.
    memo: dict[int, Any] = {}  # id(key object) -> identity: an identity's entries share one key object

    def identity(entry: Any) -> Any:
        raw = _key_of(entry)
        found = memo.get(id(raw))
        if found is None:
            found = memo[id(raw)] = _key_id(raw)
        return found

    sizes: dict[Any, int] = {}
    for c in main:
        for entry in c["add"].get("element", {}).get("elem", ()):
            k = identity(entry)
            sizes[k] = sizes.get(k, 0) + 1
    part_of: dict[Any, int] = {}
    count = last_part = 0
    for k, size in sizes.items():
        if count and count + size > max_elements:
            last_part, count = last_part + 1, 0
        part_of[k] = last_part
        count += size
    grouped: list[dict[int, list[Any]]] = [{} for _ in range(last_part + 1)]
    for i, c in enumerate(main):
        for entry in c["add"].get("element", {}).get("elem", ()):
            grouped[part_of[identity(entry)]].setdefault(i, []).append(entry)
    phases = list(todo.phases[:-1])
    for n, part in enumerate(grouped):
        commands = [_elements(main[i]["add"]["element"], part[i]) for i in sorted(part)]
        if n == 0:
            commands = [*head, *commands]
        if n == last_part:
            commands = [*commands, *tail]
        phases.append(Phase(PART if n < last_part else MAIN, tuple(commands)))
    return Plan(todo.commands, tuple(phases))


def _elements(body: dict[str, Any], entries: list[Any]) -> Command:
    """Entries added to the map an add-element command's body names."""
    return Table(body["family"], body["table"]).add_elements(body["name"], entries)


def element_count(commands: Sequence[Command]) -> int:
    """Map and set elements the commands add."""
    return sum(len(c.get("add", {}).get("element", {}).get("elem", ())) for c in commands)


def _key_of(entry: Any) -> Any:
    """An element entry's key: [key, data] for a map, the key for a set; a key with a
    comment is {"elem": {"val": key, ...}}."""
    key = entry[0] if isinstance(entry, list) else entry
    return key["elem"]["val"] if isinstance(key, dict) and "elem" in key else key


def _key_id(key: Any) -> Any:
    """A key as something hashable: the agent's concatenations as tuples (a json.dumps of
    each of 50,000 keys cost ~0.1 s of a 10,000-identity sync), anything else as JSON."""
    if isinstance(key, dict) and len(key) == 1 and isinstance(key.get("concat"), list):
        return tuple(key["concat"])
    return key if isinstance(key, (str, int)) else json.dumps(key, sort_keys=True)


def needs_text(command: Command) -> bool:
    """A map declaration nft 1.0.6's JSON parser cannot take (concatenated data)."""
    body = command.get("add", {}).get("map")
    return isinstance(body, dict) and concat_data(body)


def _json_form(command: Command) -> Command:
    """A concatenated-data map's declaration as a JSON parser that takes one (nft >=
    1.1.0) wants it: the data types as a list."""
    body = command["add"]["map"]
    decl = {k: v for k, v in body.items() if k not in ("family", "table", "name")}
    decl["map"] = str(decl["map"]).split(" . ")
    return Table(body["family"], body["table"]).add_set(body["name"], decl)


def phased(commands: Sequence[Command], family: str, table: str) -> Plan:
    """Maps only nft text can declare go first, in a text transaction of their own: empty
    and unreferenced until the main transaction commits, they change nothing in the data
    plane meanwhile, and a failed main transaction leaves at most those (the next
    read-back deletes them if unwanted). Only a change that first deletes the table or
    such a map (plan() does so only to repair a declaration someone else altered) has
    those deletes committed before, and so is not atomic."""
    declarations = [c for c in commands if needs_text(c)]
    if not declarations:
        return one_transaction(commands)
    rest = [c for c in commands if not needs_text(c)]
    declared = {c["add"]["map"]["name"] for c in declarations}
    cut = max((i + 1 for i, c in enumerate(rest)
               if "table" in c.get("delete", {}) or c.get("delete", {}).get("map", {}).get("name") in declared),
              default=0)
    phases = [Phase(PREPARE, tuple(rest[:cut]))] if cut else []
    phases.append(Phase(DECLARE, (Table(family, table).add(), *declarations)))
    if rest[cut:]:
        phases.append(Phase(MAIN, tuple(rest[cut:])))
    return Plan(tuple(commands), tuple(phases))


def _commands(current: Ruleset | None, desired: Ruleset, family: str, table: str) -> list[Command]:
    t = Table(family, table)
    cmds: list[Command] = []
    if current is not None:
        current = _redeclare(current, desired, t, cmds)
    if current is None:
        cmds.append(t.add())
        current = EMPTY

    for name, decl in desired.sets.items():
        if name not in current.sets:
            cmds.append(t.add_set(name, decl))
    for name, decl in desired.chains.items():
        if name not in current.chains:
            cmds.append(t.add_chain(name, decl))
    for name, rules in desired.rules.items():
        old = current.rules.get(name)
        if old == rules:
            continue
        if old:
            cmds.append(t.flush_chain(name))
        cmds.extend(t.add_rule(name, rule) for rule in rules)

    keys: dict[ElemKey, Any] = {}  # one JSON key per identity, shared by its elements

    def key(k: ElemKey) -> Any:
        found = keys.get(k)
        if found is None:
            found = keys[k] = key_json(k)
        return found

    for name, elements in current.elements.items():
        wanted = desired.elements.get(name)
        if wanted is None:
            continue  # the map itself goes below
        if _bucketed(elements):
            for b, doomed in sorted(bucket_changes(elements, wanted, key, entries=False).items()):
                cmds.append(t.delete_elements(bucket_map(name, b), doomed))
            continue
        gone = [key(k) for k, e in elements.items() if wanted.get(k) != e]
        if gone:
            cmds.append(t.delete_elements(name, gone))
    for name, elements in desired.elements.items():
        old = current.elements.get(name)
        if _bucketed(elements):
            for b, entries in sorted(bucket_changes(elements, old or {}, key, entries=True).items()):
                cmds.append(t.add_elements(bucket_map(name, b), entries))
            continue
        new = [[{"elem": {"val": key(k), "comment": e.comment}} if e.comment else key(k), data_json(e.value)]
               for k, e in elements.items() if not old or old.get(k) != e]
        if new:
            cmds.append(t.add_elements(name, new))

    # Stale chains are only emptied here and deleted by a later transaction (retire()):
    # kernels before 6.2 may refuse to delete a chain in the batch that removes the map
    # element pointing at it (EBUSY), as kube-proxy found.
    cmds.extend(t.flush_chain(n) for n in stale_chains(current, desired) if current.rules.get(n))
    cmds.extend(t.delete_set(n, decl) for n, decl in current.sets.items() if n not in desired.sets)
    return cmds


def _bucketed(elements: Mapping[ElemKey, Any]) -> bool:
    """Whether these elements are Buckets (all are, or none: only the chash maps' are)."""
    return type(next(iter(elements.values()), None)) is Buckets


def bucket_changes(these: Mapping[ElemKey, Any], others: Mapping[ElemKey, Any], key: Callable[[ElemKey], Any],
                   entries: bool) -> dict[int, list[Any]]:
    """Per bucket, the identities whose Buckets in `these` hold an element there that
    `others` does not hold alike: their keys (what to delete, `these` being the kernel's)
    or their [key, verdict] entries (what to add, `these` being the desired ones). Only
    the buckets that differ are written: a backend's change touches ~1/N of 61."""
    found: dict[int, list[Any]] = {}
    for k, mine in these.items():
        if type(mine) is not Buckets:
            continue
        theirs = others.get(k)
        theirs = theirs if type(theirs) is Buckets else ()
        # One [key, verdict] list per verdict the identity has, shared by its buckets: an
        # identity of N backends has N verdicts in 61 buckets (10,000 ClientIP identities x 4:
        # 40,000 lists, not 610,000, 50 MB less at the peak of a full sync).
        pairs: dict[int, list[Any]] = {}
        for b, v in enumerate(mine):
            if v is not None and (b >= len(theirs) or theirs[b] != v):
                if entries:
                    entry = pairs.get(id(v))
                    if entry is None:
                        entry = pairs[id(v)] = [key(k), v]
                else:
                    entry = key(k)
                found.setdefault(b, []).append(entry)
    return found


def stale_chains(current: Ruleset | None, desired: Ruleset) -> list[str]:
    """Chains the desired state no longer has: plan() empties them, retire() deletes them."""
    return [n for n in (current or EMPTY).chains if n not in desired.chains]


def retire(chains: list[str], family: str, table: str) -> Plan:
    """Delete chains emptied by an earlier transaction (nothing points at them any more)."""
    t = Table(family, table)
    return one_transaction(t.delete_chain(n) for n in chains)


def _redeclare(current: Ruleset, desired: Ruleset, t: Table, cmds: list[Command]) -> Ruleset | None:
    """Delete what is declared differently (appending the commands); returns the table as
    it stands after them (None: deleted whole), for the rest of the plan to fill.

    Every rule is flushed and the changed sets and chains are deleted, then declared anew
    by the rest of the plan, all in one transaction. A map only nft text can declare
    (concat_data: someone else altered one) is emptied of its users and deleted first, in
    a phase of its own (phased), then declared, then the rest: only the new connections
    that pick its slot meanwhile go without NAT. A changed chain that is not a base chain (map
    elements point at it, so it cannot be deleted) makes the table go and come back whole.
    """
    sets = [n for n, d in desired.sets.items() if n in current.sets and current.sets[n] != d]
    chains = [n for n, d in desired.chains.items() if n in current.chains and current.chains[n] != d]
    if any("hook" not in desired.chains[n] for n in chains):
        cmds.append(t.delete())
        return None
    texts = [n for n in sets if concat_data(current.sets[n]) or concat_data(desired.sets[n])]
    if texts:
        refs = {f'"@{n}"' for n in texts}
        users = [c for c, rules in current.rules.items() if any(r in json.dumps(rule) for rule in rules for r in refs)]
        cmds.extend(t.flush_chain(c) for c in users)
        cmds.extend(t.delete_set(n, current.sets[n]) for n in texts)
        current = _without(current, texts, [], users)
        sets = [n for n in sets if n not in texts]
    if not sets and not chains:
        return current
    cmds.append(t.flush())
    cmds.extend(t.delete_set(n, current.sets[n]) for n in sets)
    cmds.extend(t.delete_chain(n) for n in chains)
    return _without(current, sets, chains, current.chains)


def _without(rs: Ruleset, sets: Collection[str], chains: Collection[str], emptied: Collection[str]) -> Ruleset:
    """The table after deleting these sets (with their elements) and chains, and flushing
    the chains in `emptied`."""
    return Ruleset(
        sets={n: d for n, d in rs.sets.items() if n not in sets},
        chains={n: d for n, d in rs.chains.items() if n not in chains},
        rules={n: () if n in emptied else rs.rules.get(n, ()) for n in rs.chains if n not in chains},
        elements={n: e for n, e in rs.elements.items() if n not in sets},
    )


def document(commands: Sequence[Command]) -> str:
    """A libnftables JSON document, one command per line: readable and diff-friendly."""
    body = ",\n ".join(json.dumps(c, sort_keys=True) for c in commands)
    return '{"nftables": [\n ' + body + "\n]}\n"
