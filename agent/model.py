"""Validated model: IptablesDnatRule and IptablesEIP objects, as the API returns them, in;
this gateway's share rules out, each field checked. Pure: no I/O."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

from agent.errors import RuleError

RULE_KIND = "IptablesDnatRule"
EIP_KIND = "IptablesEIP"
DEFAULT_AFFINITY_TIMEOUT = 10800  # Kubernetes' default for ClientIP; 0 means this too
MAX_AFFINITY_TIMEOUT = 86400
CLIENT_IP = "ClientIP"

# DNS-1123 subdomain, as the API server enforces for metadata.name; a directory source
# gets no such check, and the name ends up in nft comments and logs.
_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4_RE = re.compile(r"\.".join([_OCTET] * 4), re.ASCII)


class Identity(NamedTuple):
    """One load-balanced service: what the client dials. (A tuple: 10,000 of them are
    hashed and sorted on every full sync, and tuples do that in C.)"""

    eip: str
    port: int
    proto: str  # "tcp" or "udp"

    def __str__(self) -> str:
        return f"{self.eip}:{self.port}/{self.proto}"


class Backend(NamedTuple):
    ip: str
    port: int

    def __str__(self) -> str:
        return f"{self.ip}:{self.port}"


class Rule(NamedTuple):
    """A valid share DNAT rule of this gateway. (A tuple, like Identity: 40,000 of them
    are built on a full sync at 10,000 identities, 3x faster than a frozen dataclass.)"""

    name: str
    identity: Identity
    backend: Backend
    affinity: bool
    timeout: int  # effective seconds; meaningful only with affinity


@dataclass(frozen=True)
class Inventory:
    """What the objects say about this gateway: usable rules and rejected ones."""

    rules: tuple[Rule, ...] = ()
    errors: tuple[RuleError, ...] = field(default=())


@dataclass(frozen=True)
class Eip:
    """An IptablesEIP as far as ownership goes: the gateways it names (one, or several
    when a directory defines the name twice) and its address (or why not)."""

    name: str
    gateways: frozenset[str]
    address: str | None
    error: RuleError | None


def build_inventory(objects: Iterable[Any], gateway: str) -> Inventory:
    """Select and validate this gateway's share rules among arbitrary objects.

    Never raises on input: what cannot be used becomes a RuleError. Objects that are not
    ours (other kinds, exclusive rules, other gateways' EIPs) are left out silently.
    """
    by_kind = index_objects(objects)
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


def index_objects(objects: Iterable[Any]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Live objects of the two kinds, by kind and name (a list: a directory may repeat one)."""
    by_kind: dict[str, dict[str, list[dict[str, Any]]]] = {RULE_KIND: {}, EIP_KIND: {}}
    for obj in objects:  # live() and _name_of() inlined: this runs for every object
        kind = obj.get("kind") if isinstance(obj, dict) else None
        named = by_kind.get(kind) if isinstance(kind, str) else None
        meta = obj.get("metadata") if named is not None else None
        if isinstance(meta, dict) and not meta.get("deletionTimestamp"):
            name = meta.get("name")
            if isinstance(name, str) and name:  # else nothing to name it by, nor to resolve it with
                copies = named.get(name)
                if copies is None:
                    named[name] = [obj]
                else:
                    copies.append(obj)
    return by_kind


def live(obj: dict[str, Any]) -> bool:
    """False for an object being deleted: it is gone at once, finalizer or not."""
    meta = obj.get("metadata")
    return not (isinstance(meta, dict) and meta.get("deletionTimestamp"))


def eip_of(name: str, copies: list[dict[str, Any]]) -> Eip:
    if len(copies) > 1:
        # Names are unique in the API; twice in a directory is ambiguous ownership, the
        # same whichever copy comes first.
        return Eip(name, frozenset().union(*(_gateways(c) for c in copies)), None,
                   RuleError(EIP_KIND, name, "metadata.name", "defined more than once"))
    return _parse_eip(name, copies[0])


def _gateways(obj: dict[str, Any]) -> frozenset[str]:
    gateway = _spec(obj).get("natGwDp")
    return frozenset([gateway]) if isinstance(gateway, str) else frozenset()


def eip_reference(obj: dict[str, Any]) -> str | None:
    """The EIP name a rule points at (any gateway), for re-evaluation when the EIP changes."""
    ref = _spec(obj).get("eip")
    return ref if isinstance(ref, str) else None


def rule_of(name: str, copies: list[dict[str, Any]], eips: dict[str, Eip], gateway: str) -> Rule | RuleError | None:
    """This gateway's share rule of that name: a Rule, a RuleError, or None if not ours.

    A name defined more than once (a directory can) is refused if any copy is ours, and
    ignored if none is: the same answer whatever the order of the copies."""
    if len(copies) > 1:
        if all(_owner(c, eips, gateway) is None for c in copies):
            return None
        # No one copy to point at: no uid, no version.
        return RuleError(RULE_KIND, name, "metadata.name", f"defined {len(copies)} times; none is used")
    obj = copies[0]
    eip = _owner(obj, eips, gateway)
    if eip is None:
        return None  # ownership goes through the EIP; unresolved means not (yet) ours
    try:
        return _parse_rule(name, obj["spec"], eip)
    except RuleError as err:
        meta = obj.get("metadata")
        uid, version = (str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")) if isinstance(meta, dict) else ("", "")
        return RuleError(err.kind, err.name, err.field, err.reason, uid, version)


def _owner(obj: dict[str, Any], eips: dict[str, Eip], gateway: str) -> Eip | None:
    """The EIP through which this rule object is a share rule of this gateway, if it is."""
    spec = obj.get("spec")
    if not isinstance(spec, dict) or spec.get("type") != "share" or not isinstance(spec.get("eip"), str):
        return None
    eip = eips.get(spec["eip"])
    return eip if eip is not None and gateway in eip.gateways else None


def _spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, dict) else {}


def _name_of(obj: dict[str, Any]) -> str | None:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None


def _parse_eip(name: str, obj: dict[str, Any]) -> Eip:
    spec = _spec(obj)
    status = obj.get("status") if isinstance(obj.get("status"), dict) else {}
    gateways = _gateways(obj)
    try:
        if status.get("ip"):
            address = _ipv4(EIP_KIND, name, "status.ip", status.get("ip"))
        else:
            address = _ipv4(EIP_KIND, name, "spec.v4ip", spec.get("v4ip"))
        return Eip(name, gateways, address, None)
    except RuleError as err:
        return Eip(name, gateways, None, err)


def _parse_rule(name: str, spec: dict[str, Any], eip: Eip) -> Rule:
    if len(name) > 253 or not _NAME_RE.fullmatch(name):
        raise RuleError(RULE_KIND, name, "metadata.name", "not a DNS-1123 subdomain")
    if eip.error is not None:
        raise RuleError(RULE_KIND, name, "spec.eip", f"IptablesEIP {eip.name!r}: {eip.error.field}: {eip.error.reason}")
    assert eip.address is not None
    proto = spec.get("protocol")
    if not isinstance(proto, str) or proto.lower() not in ("tcp", "udp"):
        raise RuleError(RULE_KIND, name, "spec.protocol", f"{proto!r} is not tcp or udp")
    external = _port(name, "spec.externalPort", spec.get("externalPort"))
    internal_ip = _ipv4(RULE_KIND, name, "spec.internalIp", spec.get("internalIp"))
    internal = _port(name, "spec.internalPort", spec.get("internalPort"))
    affinity = spec.get("sessionAffinity", "")
    if affinity not in ("", None, CLIENT_IP):
        raise RuleError(RULE_KIND, name, "spec.sessionAffinity", f"{affinity!r} is not \"\" or ClientIP")
    timeout = spec.get("sessionAffinityTimeoutSeconds", 0)
    if timeout is None:
        timeout = 0
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 0 <= timeout <= MAX_AFFINITY_TIMEOUT:
        raise RuleError(
            RULE_KIND, name, "spec.sessionAffinityTimeoutSeconds", f"{timeout!r} is not an integer in 0..{MAX_AFFINITY_TIMEOUT}"
        )
    return Rule(
        name=name,
        identity=Identity(eip.address, external, proto.lower()),
        backend=Backend(internal_ip, internal),
        affinity=affinity == CLIENT_IP,
        timeout=timeout or DEFAULT_AFFINITY_TIMEOUT,
    )


def _port(name: str, field_name: str, value: Any) -> int:
    # The CRD carries ports as decimal strings; an int is accepted too, a bool or float never.
    port = int(value) if type(value) is str and 0 < len(value) <= 5 and value.isascii() and value.isdigit() else value
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise RuleError(RULE_KIND, name, field_name, f"{value!r} is not a port in 1..65535")
    return port


def _ipv4(kind: str, name: str, field_name: str, value: Any) -> str:
    # A regex, not ipaddress: this runs for every rule on every full sync (10x faster),
    # and it is as strict (no leading zeros, no spaces, exactly four octets).
    m = _IPV4_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise RuleError(kind, name, field_name, f"{value!r} is not an IPv4 address")
    first = int(m[1])
    if value in ("0.0.0.0", "255.255.255.255") or first == 127 or 224 <= first <= 239:
        raise RuleError(kind, name, field_name, f"{value} is not a unicast address")
    return value
