"""The API's wire vocabulary as the fake speaks it: the resources it serves, errors as
metav1.Status, a request's attributes as the RBAC authorizer sees them, and the continue
tokens of paginated lists."""
from __future__ import annotations

import base64
import binascii
import json
import posixpath
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

JSON = dict[str, Any]


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    verbs: frozenset[str]  # served over HTTP; any other verb is answered 405

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``plural.group`` as the API server spells it in error messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


_WATCHED = frozenset({"list", "watch"})
RESOURCES: dict[str, ResourceType] = {r.plural: r for r in (
    ResourceType("kubeovn.io", "v1", "iptables-dnat-rules", "IptablesDnatRule", False, _WATCHED),
    ResourceType("kubeovn.io", "v1", "iptables-eips", "IptablesEIP", False, _WATCHED),
    ResourceType("", "v1", "events", "Event", True, frozenset({"create"})),
    ResourceType("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                 False, frozenset({"get"})),
)}


def resource(plural: str) -> ResourceType:
    try:
        return RESOURCES[plural]
    except KeyError:
        raise ValueError(f"unknown resource {plural!r}; known: {sorted(RESOURCES)}") from None


_REASONS = {400: "BadRequest", 404: "NotFound", 405: "MethodNotAllowed", 409: "Conflict", 410: "Expired",
            422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
            504: "Timeout"}


class ApiError(Exception):
    """An API error; the handler answers it as a Status with ``code``."""

    def __init__(self, code: int, message: str, reason: str | None = None, *,
                 details: JSON | None = None, list_continue: str | None = None) -> None:
        self.code, self.message, self.reason = code, message, reason or _REASONS.get(code, "")
        self.details, self.list_continue = details, list_continue
        super().__init__(f"{code} {self.reason}: {message}")

    def status(self) -> JSON:
        body: JSON = {"kind": "Status", "apiVersion": "v1",
                      "metadata": {"continue": self.list_continue} if self.list_continue else {},
                      "status": "Failure", "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


def not_found(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(404, f'{rtype.qualified} "{name}" not found',
                    details={"name": name, "group": rtype.group, "kind": rtype.plural})


@dataclass(frozen=True)
class Request:
    """One HTTP request, described the way the API server's RBAC authorizer sees it."""
    verb: str             # get/list/watch/create/update/patch/delete/deletecollection, or the
    #                       lower-cased HTTP method for a non-resource path
    path: str
    query: dict[str, str]
    resource: str | None  # plural, "plural/subresource" as RBAC rules spell it; None off the API
    namespace: str | None
    api_group: str        # "" for the core group
    name: str | None


_TRUE = re.compile(r"(?i)1|t|true")


def bool_param(value: str | None) -> bool:
    """Query booleans as the API server parses them (strconv.ParseBool)."""
    return value is not None and _TRUE.fullmatch(value) is not None


def parse_request(method: str, path: str, query: dict[str, str]) -> tuple[Request, str]:
    """The request's RBAC attributes and its API version, after the API server's
    RequestInfoFactory (without the deprecated /watch/ path prefix)."""
    parts = [unquote(p) for p in path.strip("/").split("/")] if path.strip("/") else []
    if len(parts) >= 3 and parts[0] == "api" or len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = ("", parts[1], parts[2:]) if parts[0] == "api" else (parts[1], parts[2], parts[3:])
    else:  # off the API, or a group or version root
        return Request(method.lower(), path, query, None, None, "", None), ""
    namespace = None
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        rest = rest[2:] or rest  # /namespaces/<ns> itself is the namespace object
    name = rest[1] if len(rest) > 1 else None
    if method in ("GET", "HEAD"):
        verb = "watch" if bool_param(query.get("watch")) else "get" if name else "list"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}.get(method, method.lower())
    return Request(verb, path, query, "/".join(rest[:1] + rest[2:]), namespace, group, name), version


# Continue tokens, as k8s.io/apiserver/pkg/storage encodes them: unpadded URL-safe base64 of
# {"v": "meta.k8s.io/v1", "rv": <the list's version>, "start": <next key, relative to the
# resource's prefix>}; rv -1 (only in a 410's token) means "go on at the latest version".

def encode_continue(start: str, rv: int) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_continue(token: str) -> tuple[str, int]:
    """(start key, resourceVersion) of a token; a bad one is the API server's 400."""
    def invalid(why: str) -> ApiError:
        return ApiError(400, f"invalid continue token: continue key is not valid: {why}")
    try:
        token_json = json.loads(base64.b64decode(token + "=" * (-len(token) % 4), altchars="-_", validate=True))
    except (binascii.Error, ValueError) as exc:
        raise invalid(str(exc)) from None
    if not isinstance(token_json, dict) or token_json.get("v") != "meta.k8s.io/v1":
        raise invalid("server does not recognize this encoded version")
    rv, start = token_json.get("rv"), token_json.get("start")
    if not isinstance(rv, int) or rv == 0:
        raise invalid("incorrect encoded start resourceVersion (version meta.k8s.io/v1)")
    if not isinstance(start, str) or not start:
        raise invalid("encoded start key empty (version meta.k8s.io/v1)")
    key = start if start.startswith("/") else "/" + start
    if key.startswith("//") or posixpath.normpath(key) != key:  # Go's path.Clean would change it
        raise invalid(start)  # no climbing out of the resource's prefix
    return key[1:], rv
