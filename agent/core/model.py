"""Validated model: IptablesDnatRule and IptablesEIP objects in, in the one form the sources
hand over (manifest(): what the model reads of an object the API returns); this gateway's
share rules out, each field checked. Pure: no I/O."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

from agent.core.health import ANNOTATION, DEFAULT, FIELD, Check, parse
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

    # A backend is also its own backend-map element (ruleset.Elem's protocol: data and no
    # comment): the one object serves the service and the table (2.9 MB at 10,000 x 4).
    @property
    def value(self) -> Backend:
        return self

    @property
    def comment(self) -> None:
        return None


class Rule(NamedTuple):
    """A valid share DNAT rule of this gateway. (A tuple, like Identity: 40,000 of them
    are built on a full sync at 10,000 identities, 3x faster than a frozen dataclass.)"""

    name: str
    identity: Identity
    backend: Backend
    affinity: bool
    timeout: int  # effective seconds; meaningful only with affinity
    eip: str  # the IptablesEIP's name (desired.py re-evaluates the rule when it changes)
    check: Check | None = DEFAULT  # how its backend is checked (health.py); None: not at all


@dataclass(frozen=True)
class Eip:
    """An IptablesEIP as far as ownership goes: the gateways it names (one, or several
    when a directory defines the name twice) and its address (or why not)."""

    name: str
    gateways: frozenset[str]
    address: str | None
    error: RuleError | None


def index_objects(objects: Iterable[Manifest]) -> dict[str, dict[str, list[Manifest]]]:
    """Objects of the two kinds, by kind and name (a list: a directory may repeat one)."""
    by_kind: dict[str, dict[str, list[Manifest]]] = {RULE_KIND: {}, EIP_KIND: {}}
    for obj in objects:
        copies = by_kind[obj.kind].get(obj.name)
        if copies is None:
            by_kind[obj.kind][obj.name] = [obj]
        else:
            copies.append(obj)
    return by_kind


_SPEC = {RULE_KIND: ("eip", "externalPort", "protocol", "internalIp", "internalPort", "type", "sessionAffinity",
                     "sessionAffinityTimeoutSeconds"),
         EIP_KIND: ("v4ip", "natGwDp")}
_STATUS = {EIP_KIND: ("ip",), RULE_KIND: ()}
_ANNOTATIONS = {EIP_KIND: (), RULE_KIND: (ANNOTATION,)}  # after the status's values
_AT = {kind: {key: i for i, key in enumerate(keys)} for kind, keys in _SPEC.items()}


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # a field the object does not have


class Manifest(tuple):  # type: ignore[type-arg]
    """What the model reads of an object (a live rule or EIP with a name), compact: the
    one form the sources hand the model (manifest() makes it). One flat tuple: (kind,
    name, uid, version, the spec's values in _SPEC[kind] order, the status's in
    _STATUS[kind] order, the annotations' in _ANNOTATIONS[kind] order), fields the object lacks MISSING; the uid and resourceVersion as
    the text an error shows ("" if none), packed as ints where they print back the same.
    Measured at 40,000 rules: the API's objects ~87 MB, dicts of the fields read ~7 MB,
    this ~4 MB."""

    __slots__ = ()

    @classmethod
    def of(cls, kind: str, name: str, uid: str, version: str, spec: Iterable[Any], status: Iterable[Any],
           annotations: Iterable[Any] = ()) -> Manifest:
        return cls((kind, name, _packed_uid(uid), _packed_version(version), *spec, *status, *annotations))

    @property
    def kind(self) -> str:
        return self[0]  # type: ignore[no-any-return]

    @property
    def name(self) -> str:
        return self[1]  # type: ignore[no-any-return]

    @property
    def uid(self) -> str:
        uid = self[2]
        if type(uid) is not int:
            return uid  # type: ignore[no-any-return]
        h = f"{uid:032x}"
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    @property
    def version(self) -> str:
        version = self[3]
        return str(version) if type(version) is int else version  # type: ignore[no-any-return]

    def field(self, key: str) -> Any:
        """A spec field's value, MISSING if absent."""
        return self[4 + _AT[self[0]][key]]

    def __repr__(self) -> str:
        return f"Manifest{tuple(self)!r}"


_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _packed_uid(uid: str) -> str | int:
    """A canonical (lower-case) UUID as its 128-bit int: 44 bytes, not 85."""
    return int(uid.replace("-", ""), 16) if _UUID_RE.fullmatch(uid) else uid


def _packed_version(version: str) -> str | int:
    """A resourceVersion of decimal digits (etcd's revision) as an int, if it prints back
    the same; anything else as given (the API calls it opaque)."""
    if version.isdigit() and version.isascii() and len(version) < 20 and (version == "0" or version[0] != "0"):
        return int(version)
    return version


def manifest(obj: Any) -> Manifest | None:
    """What the model reads of an object as the API returns it (valid or not: the model
    judges it), or None for what the model ignores: anything but a rule or an EIP with a
    non-empty string name, and an object being deleted (it is gone at once, finalizer or
    not). A spec or status that is no dict has every field MISSING. Short strings are
    interned (EIP names, protocols, ports, types repeat across thousands of rules)."""
    if type(obj) is not dict:
        return None
    kind, meta = obj.get("kind"), obj.get("metadata")
    if type(kind) is not str or kind not in _SPEC or not isinstance(meta, dict) or meta.get("deletionTimestamp"):
        return None
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None  # nothing to name it by, nor to resolve it with
    spec, status = obj.get("spec"), obj.get("status")
    spec = spec if isinstance(spec, dict) else {}
    status = status if isinstance(status, dict) else {}
    notes = meta.get("annotations")
    notes = notes if isinstance(notes, dict) else {}
    return Manifest.of(sys.intern(kind), name, str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""),
                       (_interned(k, spec.get(k, MISSING)) for k in _SPEC[kind]),
                       (status.get(k, MISSING) for k in _STATUS[kind]),
                       (_interned(k, notes.get(k, MISSING)) for k in _ANNOTATIONS[kind]))


# Fields whose values repeat across thousands of rules: interned, one string each. Not
# names or addresses, unique to their rule: interning those only grows the interpreter's
# table of interned strings (1.8 MB at 40,000 rules).
_REPEATING = frozenset({"eip", "externalPort", "protocol", "internalPort", "type", "sessionAffinity", "natGwDp",
                        ANNOTATION})


def _interned(key: str, value: Any) -> Any:
    return sys.intern(value) if key in _REPEATING and type(value) is str and len(value) <= 64 else value


def _given(value: Any, default: Any = None) -> Any:
    return default if value is MISSING else value


def eip_of(name: str, copies: list[Manifest]) -> Eip:
    if len(copies) > 1:
        # Names are unique in the API; twice in a directory is ambiguous ownership, the
        # same whichever copy comes first.
        return Eip(name, frozenset().union(*(_gateways(c) for c in copies)), None,
                   RuleError(EIP_KIND, name, "metadata.name", "defined more than once"))
    return _parse_eip(name, copies[0])


def _gateways(obj: Manifest) -> frozenset[str]:
    gateway = obj.field("natGwDp")
    return frozenset([gateway]) if isinstance(gateway, str) else frozenset()


def eip_reference(obj: Manifest) -> str | None:
    """The EIP name a rule points at (any gateway), for re-evaluation when the EIP changes."""
    ref = obj.field("eip")
    return ref if isinstance(ref, str) else None


_RULE_SPEC = _SPEC[RULE_KIND]
_RULE_SPAN = slice(4, 4 + len(_RULE_SPEC))  # a rule Manifest's spec values
_EIP_AT, _TYPE_AT = _AT[RULE_KIND]["eip"], _AT[RULE_KIND]["type"]
_NOTE_AT = _RULE_SPAN.stop + len(_STATUS[RULE_KIND])  # the health-check annotation


def rule_of(name: str, copies: list[Manifest], eips: dict[str, Eip], gateway: str,
            identities: dict[Identity, Identity] | None = None, check: Check | None = DEFAULT) -> Rule | RuleError | None:
    """This gateway's share rule of that name: a Rule, a RuleError, or None if not ours.
    `identities`, if given, holds one Identity object per identity; the Rule gets that
    one (and a new one is added), so 40,000 rules share 10,000 identities. `check`: how a
    TCP backend is checked when the rule's annotation does not say (None: not at all).

    A name defined more than once (a directory can) is refused if any copy is ours, and
    ignored if none is: the same answer whatever the order of the copies."""
    if len(copies) > 1:
        if all(_owner(c[_RULE_SPAN], eips, gateway) is None for c in copies):
            return None
        # No one copy to point at: no uid, no version.
        return RuleError(RULE_KIND, name, "metadata.name", f"defined {len(copies)} times; none is used")
    obj = copies[0]
    # The spec values in one slice, not read field by field (40,000 rules per full sync:
    # field-by-field reading was a third of the model's time).
    fields = obj[_RULE_SPAN]
    eip = _owner(fields, eips, gateway)
    if eip is None:
        return None  # ownership goes through the EIP; unresolved means not (yet) ours
    try:
        return _parse_rule(name, fields, eip, identities, obj[_NOTE_AT], check)
    except RuleError as err:
        return RuleError(err.kind, err.name, err.field, err.reason, obj.uid, obj.version)


def _owner(fields: tuple[Any, ...], eips: dict[str, Eip], gateway: str) -> Eip | None:
    """The EIP through which a rule (its spec values) is a share rule of this gateway, if it is."""
    ref = fields[_EIP_AT]
    if fields[_TYPE_AT] != "share" or type(ref) is not str:
        return None
    eip = eips.get(ref)
    return eip if eip is not None and gateway in eip.gateways else None


def _parse_eip(name: str, obj: Manifest) -> Eip:
    status_ip = _given(obj[-1])  # the status's one field, ip
    gateways = _gateways(obj)
    try:
        if status_ip:
            address = _ipv4(EIP_KIND, name, "status.ip", status_ip)
        else:
            address = _ipv4(EIP_KIND, name, "spec.v4ip", _given(obj.field("v4ip")))
        return Eip(name, gateways, address, None)
    except RuleError as err:
        return Eip(name, gateways, None, err)


_PROTOCOLS = {"tcp": sys.intern("tcp"), "udp": sys.intern("udp")}


def _parse_rule(name: str, fields: tuple[Any, ...], eip: Eip, identities: dict[Identity, Identity] | None,
                note: Any, default: Check | None) -> Rule:
    if len(name) > 253 or not _NAME_RE.fullmatch(name):
        raise RuleError(RULE_KIND, name, "metadata.name", "not a DNS-1123 subdomain")
    if eip.error is not None:
        raise RuleError(RULE_KIND, name, "spec.eip", f"IptablesEIP {eip.name!r}: {eip.error.field}: {eip.error.reason}")
    assert eip.address is not None
    _, external, proto, internal_ip, internal, _, affinity, timeout = fields  # in _SPEC[RULE_KIND] order
    protocol = _PROTOCOLS.get(proto.lower()) if type(proto) is str else None
    if protocol is None:
        raise RuleError(RULE_KIND, name, "spec.protocol", f"{_given(proto)!r} is not tcp or udp")
    external = _port(name, "spec.externalPort", external)
    internal_ip = _ipv4(RULE_KIND, name, "spec.internalIp", internal_ip)
    internal = _port(name, "spec.internalPort", internal)
    affinity = _given(affinity, "")
    if affinity not in ("", None, CLIENT_IP):
        raise RuleError(RULE_KIND, name, "spec.sessionAffinity", f"{affinity!r} is not \"\" or ClientIP")
    timeout = _given(timeout, 0)
    if timeout is None:
        timeout = 0
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 0 <= timeout <= MAX_AFFINITY_TIMEOUT:
        raise RuleError(
            RULE_KIND, name, "spec.sessionAffinityTimeoutSeconds", f"{timeout!r} is not an integer in 0..{MAX_AFFINITY_TIMEOUT}"
        )
    if note is MISSING:  # most rules: health.parse("")'s answer, without its call (40,000 a full sync)
        check = default if protocol == "tcp" else None
    elif type(note) is not str:
        raise RuleError(RULE_KIND, name, FIELD, f"{note!r} is not a string")
    else:
        try:
            check = parse(note, protocol, default)
        except ValueError as err:
            raise RuleError(RULE_KIND, name, FIELD, str(err)) from None
    identity = Identity(eip.address, external, protocol)
    if identities is not None:
        identity = identities.setdefault(identity, identity)
    # Positional: a NamedTuple built by keyword costs twice as much (40,000 per full sync).
    return Rule(name, identity, Backend(internal_ip, internal), affinity == CLIENT_IP,
                timeout or DEFAULT_AFFINITY_TIMEOUT, eip.name, check)


def _port(name: str, field_name: str, value: Any) -> int:
    # The CRD carries ports as decimal strings; an int is accepted too, a bool or float never.
    if type(value) is str:
        port = _PORT_TEXTS.get(value)
        if port is not None:
            return port  # 80,000 ports per full sync, a few distinct: a third of the parse
    port = int(value) if type(value) is str and 0 < len(value) <= 5 and value.isascii() and value.isdigit() else value
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise RuleError(RULE_KIND, name, field_name, f"{_given(value)!r} is not a port in 1..65535")
    port = _PORTS.setdefault(port, port) if len(_PORTS) < 65536 else port
    if type(value) is str and len(_PORT_TEXTS) < 65536:
        _PORT_TEXTS[value] = port
    return port


# One int object per port number in use (ints above 256 are not shared by Python: 80,000
# rules would hold 80,000 of them, 2.2 MB); and each valid port text seen, to its int.
_PORTS: dict[int, int] = {}
_PORT_TEXTS: dict[str, int] = {}


def _ipv4(kind: str, name: str, field_name: str, value: Any) -> str:
    # A regex, not ipaddress: this runs for every rule on every full sync (10x faster),
    # and it is as strict (no leading zeros, no spaces, exactly four octets).
    m = _IPV4_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise RuleError(kind, name, field_name, f"{_given(value)!r} is not an IPv4 address")
    first = int(m[1])
    if value in ("0.0.0.0", "255.255.255.255") or first == 127 or 224 <= first <= 239:
        raise RuleError(kind, name, field_name, f"{value} is not a unicast address")
    return value
