"""Oracles: the whole-input forms of the agent's incremental and kernel-facing code, which
only tests use (the agent itself evaluates object by object, and reads its table back
over netlink). Each states plainly what the product computes a faster way."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from agent.core.desired import DesiredState, ListCatalog, Service, service_of
from agent.core.layout import affinity_slot, in_render_form
from agent.core.model import _SPEC, _STATUS, EIP_KIND, MISSING, RULE_KIND, Identity, Manifest, Rule, eip_of, \
    index_objects, manifest, rule_of
from agent.core.render import Snat, render_all
from agent.core.ruleset import Elem, ElemKey, Ruleset, element, goto
from agent.ops.report import Reporter
from agent.settings import Settings
from agent.errors import RuleError


def kept(objects: Iterable[Any]) -> list[Manifest]:
    """Objects as the API returns them, as a source keeps them (what the model ignores
    dropped); manifests (a source's objects already) as they are."""
    return [m for obj in objects if (m := obj if type(obj) is Manifest else manifest(obj)) is not None]


@dataclass(frozen=True)
class Inventory:
    """What the objects say about this gateway: usable rules and rejected ones."""

    rules: tuple[Rule, ...] = ()
    errors: tuple[RuleError, ...] = field(default=())


def build_inventory(objects: Iterable[Any], gateway: str) -> Inventory:
    """Select and validate this gateway's share rules among arbitrary objects (as the API
    returns them), all at once.

    Never raises on input: what cannot be used becomes a RuleError. Objects that are not
    ours (other kinds, exclusive rules, other gateways' EIPs) are left out silently.
    """
    by_kind = index_objects(kept(objects))
    eips = {name: eip_of(name, copies) for name, copies in by_kind[EIP_KIND].items()}
    rules: list[Rule] = []
    errors: list[RuleError] = []
    for name, copies in by_kind[RULE_KIND].items():
        result = rule_of(name, copies, eips, gateway)
        if isinstance(result, Rule):
            rules.append(result)
        elif result is not None:
            errors.append(result)
    return Inventory(rules=tuple(rules), errors=tuple(errors))


@dataclass(frozen=True)
class Desired:
    services: dict[Identity, Service]
    errors: tuple[RuleError, ...]  # identities refused as a whole (e.g. too many backends)
    notes: tuple[str, ...]  # sibling disagreements, resolved deterministically


def desired_services(rules: Iterable[Rule], max_backends: int) -> Desired:
    """Group rules by identity, all at once (DesiredState does it object by object)."""
    grouped: dict[Identity, list[Rule]] = defaultdict(list)
    for rule in rules:
        grouped[rule.identity].append(rule)
    services: dict[Identity, Service] = {}
    errors: list[RuleError] = []
    notes: list[str] = []
    for identity, members in sorted(grouped.items()):
        service, refused, note = service_of(identity, members, max_backends)
        if service is not None:
            services[identity] = service
        errors.extend(refused)
        notes.extend([note] if note else [])
    return Desired(services=services, errors=tuple(errors), notes=tuple(notes))


def as_dict(obj: Manifest) -> dict[str, Any]:
    """A manifest as the dict it stands for (what the model read of the object)."""
    meta = {"name": obj.name, **{k: v for k, v in (("uid", obj.uid), ("resourceVersion", obj.version)) if v}}
    spec = {k: v for k, v in zip(_SPEC[obj.kind], obj[4:4 + len(_SPEC[obj.kind])]) if v is not MISSING}
    out: dict[str, Any] = {"kind": obj.kind, "metadata": meta, "spec": spec}
    status = {k: v for k, v in zip(_STATUS[obj.kind], obj[4 + len(_SPEC[obj.kind]):]) if v is not MISSING}
    if status:
        out["status"] = status
    return out


def affinity_sets(ruleset: Ruleset) -> list[str]:
    """The affinity sets a ruleset declares."""
    return sorted(n for n in ruleset.sets if affinity_slot(n) is not None)


_SET_FIELDS = ("type", "map", "flags", "size", "stmt")
_CHAIN_FIELDS = ("type", "hook", "prio", "policy")


def from_listing(listing: Mapping[str, Any]) -> Ruleset:
    """Parse `nft -j list table` output (one table) into a Ruleset: the text tool's view
    of a table, against which the agent's netlink read-back is checked."""
    sets: dict[str, dict[str, Any]] = {}
    chains: dict[str, dict[str, Any]] = {}
    rules: dict[str, list[dict[str, Any]]] = {}
    elements: dict[str, dict[ElemKey, Elem]] = {}
    for item in listing.get("nftables", []):
        kind, body = next(iter(item.items()))
        if kind in ("set", "map"):
            sets[body["name"]] = {k: body[k] for k in _SET_FIELDS if k in body}
            if kind == "map":
                elements[body["name"]] = dict(_parse_elem(e) for e in body.get("elem", []))
        elif kind == "chain":
            chains[body["name"]] = {k: body[k] for k in _CHAIN_FIELDS if k in body}
            rules.setdefault(body["name"], [])
        elif kind == "rule":
            rule = {"expr": body["expr"]}
            if "comment" in body:
                rule["comment"] = body["comment"]
            rules.setdefault(body["chain"], []).append(rule)
    # the agent's bucketed map folded as the agent reads it back (agent/kernel/view.py)
    return in_render_form(Ruleset(sets=sets, chains=chains, rules={c: tuple(r) for c, r in rules.items()},
                                  elements=elements))


def _parse_elem(item: Any) -> tuple[ElemKey, Elem]:
    raw_key, value = item
    comment = None
    if isinstance(raw_key, dict) and "elem" in raw_key:
        comment = raw_key["elem"].get("comment")
        raw_key = raw_key["elem"]["val"]
    key = tuple(raw_key["concat"]) if isinstance(raw_key, dict) and "concat" in raw_key else (raw_key,)
    return key, element(_data_of(value), comment)


def _data_of(value: Any) -> Any:
    """Element data from nft JSON into Elem's form."""
    if isinstance(value, dict):
        if "concat" in value and isinstance(value["concat"], list):
            return tuple(value["concat"])
        target = value.get("goto", {}).get("target") if len(value) == 1 else None
        if isinstance(target, str) and len(value["goto"]) == 1:
            return goto(target)
    return value


def render(services: Mapping[Identity, Service], previous: Ruleset, affinity_set_size: int, priority: int,
           snat: Snat | None = None) -> Ruleset:
    """The whole table for these services; slots follow `previous` (the kernel's state): the
    renderer's whole output, without the pieces a sync keeps."""
    return render_all(services, previous, affinity_set_size, priority, snat=snat)[0]


def evaluate(objects: Iterable[Any], settings: Settings, reporter: Reporter) -> tuple[DesiredState, int]:
    """Objects -> validated model -> desired services, reporting what was left out, as a
    sync evaluates them (limits included). Returns the state (its `services`) and how
    many rules were rejected."""
    state = DesiredState(settings.gateway, settings.max_backends, settings.max_identities)
    state.rebuild(ListCatalog(objects))
    reporter.report(state.errors, state.notes)
    return state, len(state.errors)
