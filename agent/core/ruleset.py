"""The agent's table as a value: declarations, rules and map elements, in the exact JSON
form `nft -j list table` gives back, so what was rendered and what the kernel holds
compare with ==. Pure: no I/O."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple

ElemKey = tuple[Any, ...]  # an element's key, e.g. ("172.18.0.10", "tcp", 80)


class Elem(NamedTuple):
    """One map element's data and comment. (A tuple: 50,000 of them on a full sync.)

    The data in a form that costs little and compares by meaning: concatenated data as a
    tuple (a backend is its Backend, ("10.0.1.11", 8080), the very object the service
    holds), a verdict as nft's JSON shared by every element with that verdict (goto()).
    data_json() gives the JSON nft takes. Measured at 10,000 identities x 4: {"concat":
    [ip, port]} dicts per element and a verdict dict per services element cost 15 MB.

    An element without a comment whose data is a concatenation is not wrapped: the data
    tuple is its own element (Data, or the Backend itself: both answer .value and
    .comment), 2.9 MB less at 10,000 x 4. element() picks the form; build every element
    with it, so that == compares meanings."""

    value: Any  # ("10.0.1.11", 8080), or {"goto": {"target": chain}} (shared: never change one)
    comment: str | None = None


class Data(tuple):  # type: ignore[type-arg]
    """Concatenated data read back, without a comment: its own element (see Elem)."""

    __slots__ = ()

    @property
    def value(self) -> Data:
        return self

    @property
    def comment(self) -> None:
        return None


class Buckets(Data):
    """One identity's element in a bucketed family of maps (layout.CHASH): entry b is its
    element in map `bucket_map(name, b)` (None: that map holds none for it). Its own
    element, like Data, so that an identity's 61 kernel elements compare, plan and chunk
    as one (and cost one tuple, not 61 dictionary entries): the planner writes only the
    buckets that differ (plan.bucket_changes). Told apart from Data by its exact type."""

    __slots__ = ()


def element(value: Any, comment: str | None = None) -> Any:
    """The element of this data and comment, in its one form (see Elem)."""
    if comment is None and isinstance(value, tuple):
        return value if hasattr(value, "comment") else Data(value)
    return Elem(value, comment)


@dataclass(frozen=True)
class Ruleset:
    """One table's content that the agent manages. Dynamic set contents are not part of
    it: the kernel fills those (affinity), the agent only ever deletes from them."""

    sets: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> declaration (maps too)
    chains: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> declaration
    rules: dict[str, tuple[dict[str, Any], ...]] = field(default_factory=dict)  # chain -> rules
    elements: dict[str, dict[ElemKey, Elem]] = field(default_factory=dict)  # map -> key -> element


EMPTY = Ruleset()

def concat_data(decl: Mapping[str, Any]) -> bool:
    """A map whose data is a concatenation (nft 1.0.6 lists its type as "a . b"): its JSON
    parser cannot declare one, so the planner has it declared in text."""
    return " . " in str(decl.get("map", ""))


def bucket_map(name: str, bucket: int) -> str:
    """The map holding bucket `bucket` of the Buckets kept under `name`."""
    return f"{name}_{bucket}"


def holds(name: str, sets: Mapping[str, Any]) -> bool:
    """Whether the elements kept under `name` have their map(s) declared in `sets`: the map
    itself, or the bucket maps of Buckets kept under it."""
    return name in sets or bucket_map(name, 0) in sets


def key_json(key: ElemKey) -> Any:
    return {"concat": list(key)} if len(key) > 1 else key[0]


def data_json(value: Any) -> Any:
    """An element's data as nft JSON (a tuple is a concatenation)."""
    return {"concat": list(value)} if isinstance(value, tuple) else value


_GOTOS: dict[str, dict[str, Any]] = {}


def goto(target: str) -> dict[str, Any]:
    """{"goto": {"target": target}}, one shared dict per chain (a few dozen chains serve
    10,000 elements). Never change the dict returned."""
    found = _GOTOS.get(target)
    if found is None:
        found = {"goto": {"target": target}}
        if len(_GOTOS) < 4096:  # chains read back from an altered table are not kept forever
            _GOTOS[target] = found
    return found


def patched(rs: Ruleset, before: Ruleset, after: Ruleset) -> Ruleset:
    """`rs` with a partial change applied: the elements in `before` replaced by those in
    `after`, and the declarations, chains and rules of `after` (which carries all of
    them). Maps `after` no longer declares go with their elements. `rs`'s element
    dictionaries are updated in place (copying 50,000 elements per change would cost more
    than the change)."""
    elements = rs.elements
    for name, gone in before.elements.items():
        held = elements.get(name)
        if held is not None:
            for key in gone:
                held.pop(key, None)
    for name in [n for n in elements if not holds(n, after.sets)]:
        del elements[name]
    for name, new in after.elements.items():
        elements.setdefault(name, {}).update(new)
    return Ruleset(after.sets, after.chains, after.rules, elements)


def truncate_comment(names: Iterable[str], limit: int = 128) -> str:
    """Join rule names for an nft comment (the kernel keeps at most 128 bytes)."""
    names = names if isinstance(names, (list, tuple)) else list(names)
    text = ",".join(names)
    if len(text) <= limit:
        return text
    kept: list[str] = []
    for i, name in enumerate(names):
        suffix = f",+{len(names) - i} more"
        if len(",".join(kept + [name])) + len(suffix) > limit:
            return ",".join(kept) + suffix
        kept.append(name)
    return text
