"""Validated model: IptablesDnatRule and IptablesEIP objects, as the API returns them, in;
this gateway's share rules out, each field checked. Pure: no I/O."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from agent.errors import RuleError

RULE_KIND = "IptablesDnatRule"
EIP_KIND = "IptablesEIP"
DEFAULT_AFFINITY_TIMEOUT = 10800  # Kubernetes' default for ClientIP; 0 means this too
MAX_AFFINITY_TIMEOUT = 86400
CLIENT_IP = "ClientIP"

# DNS-1123 subdomain, as the API server enforces for metadata.name; a directory source
# gets no such check, and the name ends up in nft comments and logs.
_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_PORT_RE = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True, order=True)
class Identity:
    """One load-balanced service: what the client dials."""

    eip: str
    port: int
    proto: str  # "tcp" or "udp"

    def __str__(self) -> str:
        return f"{self.eip}:{self.port}/{self.proto}"


@dataclass(frozen=True, order=True)
class Backend:
    ip: str
    port: int

    def __str__(self) -> str:
        return f"{self.ip}:{self.port}"


@dataclass(frozen=True)
class Rule:
    """A valid share DNAT rule of this gateway."""

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
class _Eip:
    name: str
    gateway: Any
    address: str | None
    error: RuleError | None


def build_inventory(objects: Iterable[Any], gateway: str) -> Inventory:
    """Select and validate this gateway's share rules among arbitrary objects.

    Never raises on input: what cannot be used becomes a RuleError. Objects that are not
    ours (other kinds, exclusive rules, other gateways' EIPs) are left out silently.
    """
    dnat: dict[str, list[Mapping[str, Any]]] = {}
    eips: dict[str, _Eip] = {}
    for obj in objects:
        if not isinstance(obj, Mapping) or _deleting(obj):
            continue
        kind = obj.get("kind")
        name = _name_of(obj)
        if name is None:
            continue  # nothing to name it by, nor to resolve it with
        if kind == EIP_KIND:
            # Names are unique in the API; twice in a directory is ambiguous ownership.
            eips[name] = _parse_eip(name, obj) if name not in eips else _Eip(
                name, eips[name].gateway, None, RuleError(EIP_KIND, name, "metadata.name", "defined more than once"))
        elif kind == RULE_KIND:
            dnat.setdefault(name, []).append(obj)
    rules: list[Rule] = []
    errors: list[RuleError] = []
    for name, copies in dnat.items():
        obj = copies[0]
        spec = obj.get("spec")
        if not isinstance(spec, Mapping) or spec.get("type") != "share":
            continue
        eip = eips.get(spec.get("eip")) if isinstance(spec.get("eip"), str) else None
        if eip is None or eip.gateway != gateway:
            continue  # ownership goes through the EIP; unresolved means not (yet) ours
        try:
            if len(copies) > 1:
                raise RuleError(RULE_KIND, name, "metadata.name", f"defined {len(copies)} times; none is used")
            rules.append(_parse_rule(name, spec, eip))
        except RuleError as err:
            meta = obj.get("metadata")
            uid, version = (str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")) if isinstance(meta, Mapping) else ("", "")
            errors.append(RuleError(err.kind, err.name, err.field, err.reason, uid, version))
    return Inventory(rules=tuple(rules), errors=tuple(errors))


def _deleting(obj: Mapping[str, Any]) -> bool:
    meta = obj.get("metadata")
    return isinstance(meta, Mapping) and bool(meta.get("deletionTimestamp"))


def _name_of(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) and name else None


def _parse_eip(name: str, obj: Mapping[str, Any]) -> _Eip:
    spec = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
    status = obj.get("status") if isinstance(obj.get("status"), Mapping) else {}
    gateway = spec.get("natGwDp")
    try:
        if status.get("ip"):
            address = _ipv4(EIP_KIND, name, "status.ip", status.get("ip"))
        else:
            address = _ipv4(EIP_KIND, name, "spec.v4ip", spec.get("v4ip"))
        return _Eip(name, gateway, address, None)
    except RuleError as err:
        return _Eip(name, gateway, None, err)


def _parse_rule(name: str, spec: Mapping[str, Any], eip: _Eip) -> Rule:
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
    port = int(value) if isinstance(value, str) and _PORT_RE.fullmatch(value) else value
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise RuleError(RULE_KIND, name, field_name, f"{value!r} is not a port in 1..65535")
    return port


def _ipv4(kind: str, name: str, field_name: str, value: Any) -> str:
    try:
        if not isinstance(value, str):
            raise ValueError
        addr = ipaddress.IPv4Address(value)
    except ValueError:
        raise RuleError(kind, name, field_name, f"{value!r} is not an IPv4 address") from None
    if addr.is_unspecified or addr.is_multicast or addr.is_loopback or addr == ipaddress.IPv4Address("255.255.255.255"):
        raise RuleError(kind, name, field_name, f"{value} is not a unicast address")
    return str(addr)
