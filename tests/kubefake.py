"""In-process fake Kubernetes API server for the kube-ovn CRDs the agent watches.

No apiserver can run on the test machines, so this speaks just enough of the real wire protocol
(JSON over HTTP/1.1, chunked watch streams, Status errors, global resourceVersions, 410 after
compaction, BOOKMARKs) for the official ``kubernetes`` Python client to talk to it unchanged.
Only the standard library is used, so the fake can also run inside a network namespace.

Resources served (group/version/plural):
  kubeovn.io/v1 iptables-dnat-rules   cluster-scoped, kind IptablesDnatRule, status subresource
  kubeovn.io/v1 iptables-eips         cluster-scoped, kind IptablesEIP, status subresource
  v1 events (core)                    namespaced, kind Event

Semantics that differ from a real apiserver, on purpose:
  * no auth, no admission, no schema validation, no finalizers, no discovery endpoints;
  * ``limit``/``continue`` are ignored (everything comes back in one page);
  * fixture methods (create/update/patch) store ``status`` as given, so tests can set the world
    state in one call; over HTTP the status subresource rules apply (create and main-resource
    PUT/PATCH keep the stored status, ``/status`` changes only status), like kube-ovn's CRDs.
"""
from __future__ import annotations

import copy
import json
import queue
import re
import secrets
import select
import selectors
import socket
import string
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

JSON = dict[str, Any]

__all__ = [
    "FakeKube", "FakeKubeError", "Request", "ResourceType", "RESOURCES", "LabelRequirement",
    "SelectorError", "parse_label_selector", "labels_match", "merge_patch",
]


# ---------------------------------------------------------------------------------------------
# Resource types
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    has_status: bool
    # fieldSelector label -> path into the object; the apiserver rejects any other label.
    field_labels: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False, compare=False)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    @property
    def qualified(self) -> str:
        """``plural.group`` as the apiserver spells it in error messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


_META_FIELDS: dict[str, tuple[str, ...]] = {"metadata.name": ("metadata", "name"),
                                             "metadata.namespace": ("metadata", "namespace")}
_EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    **_META_FIELDS,
    **{f"involvedObject.{f}": ("involvedObject", f)
       for f in ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")},
    "reason": ("reason",), "reportingComponent": ("reportingComponent",),
    "source": ("source", "component"), "type": ("type",),
}

RESOURCES: dict[str, ResourceType] = {r.plural: r for r in (
    ResourceType("kubeovn.io", "v1", "iptables-dnat-rules", "IptablesDnatRule", False, True, _META_FIELDS),
    ResourceType("kubeovn.io", "v1", "iptables-eips", "IptablesEIP", False, True, _META_FIELDS),
    ResourceType("", "v1", "events", "Event", True, False, _EVENT_FIELDS),
)}


def _resource_for(group: str, version: str, plural: str) -> ResourceType | None:
    rtype = RESOURCES.get(plural)
    if rtype is None or rtype.group != group or rtype.version != version:
        return None
    return rtype


def _rtype(plural: str) -> ResourceType:
    try:
        return RESOURCES[plural]
    except KeyError:
        raise ValueError(f"unknown resource {plural!r}; known: {sorted(RESOURCES)}") from None


# ---------------------------------------------------------------------------------------------
# Errors rendered as metav1.Status
# ---------------------------------------------------------------------------------------------

_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
            405: "MethodNotAllowed", 409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType",
            422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
            504: "Timeout"}


def status_body(code: int, message: str, reason: str | None = None,
                details: JSON | None = None) -> JSON:
    body: JSON = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": message, "reason": reason or _REASONS.get(code, ""), "code": code}
    if details:
        body["details"] = details
    return body


class FakeKubeError(Exception):
    """An API error; the HTTP layer turns it into a Status response with ``code``."""

    def __init__(self, code: int, message: str, reason: str | None = None,
                 details: JSON | None = None) -> None:
        super().__init__(f"{code} {reason or _REASONS.get(code, '')}: {message}")
        self.code = code
        self.reason = reason or _REASONS.get(code, "")
        self.message = message
        self.details = details

    def status(self) -> JSON:
        return status_body(self.code, self.message, self.reason, self.details)


def _not_found(rtype: ResourceType, name: str) -> FakeKubeError:
    return FakeKubeError(404, f'{rtype.qualified} "{name}" not found',
                         details={"name": name, "group": rtype.group, "kind": rtype.plural})


# ---------------------------------------------------------------------------------------------
# Label and field selectors
# ---------------------------------------------------------------------------------------------

class SelectorError(ValueError):
    pass


_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SEL_WORD = re.compile(r"[^\s=!(),<>]+")


def _check_label_key(key: str) -> None:
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        raise SelectorError(f"invalid label key {key!r}: bad prefix")
    if not name or len(name) > 63 or not _NAME_PART.fullmatch(name):
        raise SelectorError(f"invalid label key {key!r}")


def _check_label_value(value: str) -> None:
    if value and (len(value) > 63 or not _NAME_PART.fullmatch(value)):
        raise SelectorError(f"invalid label value {value!r}")


@dataclass(frozen=True)
class LabelRequirement:
    key: str
    op: str  # "exists", "!", "=", "!=", "in", "notin", ">", "<"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return not present or value not in self.values
        # ">" / "<": the apiserver compares integers and fails the match on non-integer labels.
        try:
            number = int(value) if value is not None else None
        except ValueError:
            return False
        if number is None:
            return False
        bound = int(self.values[0])
        return number > bound if self.op == ">" else number < bound


def _selector_tokens(text: str) -> list[str]:
    tokens: list[str] = []
    i = 0
    while i < len(text):
        if text[i].isspace():
            i += 1
        elif text.startswith(("==", "!="), i):
            tokens.append(text[i:i + 2])
            i += 2
        elif text[i] in "=!(),<>":
            tokens.append(text[i])
            i += 1
        else:
            match = _SEL_WORD.match(text, i)
            assert match is not None  # every other character is a word character
            tokens.append(match.group())
            i = match.end()
    return tokens


_SEL_OPS = {"==", "!=", "=", "!", "(", ")", ",", "<", ">"}


def parse_label_selector(text: str) -> tuple[LabelRequirement, ...]:
    """Parse a label selector string the way k8s.io/apimachinery/pkg/labels.Parse does."""
    tokens = _selector_tokens(text)
    pos = 0
    reqs: list[LabelRequirement] = []

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take(what: str) -> str:
        nonlocal pos
        tok = peek()
        if tok is None:
            raise SelectorError(f"{text!r}: expected {what}, found end of selector")
        pos += 1
        return tok

    def take_word(what: str) -> str:
        tok = take(what)
        if tok in _SEL_OPS:
            raise SelectorError(f"{text!r}: expected {what}, found {tok!r}")
        return tok

    if not tokens:
        return ()
    while True:
        tok = take("a requirement")
        if tok == "!":
            key = take_word("a label key after '!'")
            _check_label_key(key)
            reqs.append(LabelRequirement(key, "!"))
        elif tok not in _SEL_OPS:
            key = tok
            _check_label_key(key)
            nxt = peek()
            if nxt is None or nxt == ",":
                reqs.append(LabelRequirement(key, "exists"))
            elif nxt in ("=", "==", "!="):
                pos += 1
                after = peek()
                value = "" if after is None or after == "," else take_word("a label value")
                _check_label_value(value)
                reqs.append(LabelRequirement(key, "!=" if nxt == "!=" else "=", (value,)))
            elif nxt in ("<", ">"):
                pos += 1
                value = take_word("an integer")
                if not re.fullmatch(r"-?\d+", value):
                    raise SelectorError(f"{text!r}: {nxt!r} needs an integer, found {value!r}")
                reqs.append(LabelRequirement(key, nxt, (value,)))
            elif nxt in ("in", "notin"):
                pos += 1
                if take("'('") != "(":
                    raise SelectorError(f"{text!r}: expected '(' after {nxt!r}")
                values: list[str] = []
                if peek() == ")":
                    raise SelectorError(f"{text!r}: for 'in', 'notin' operators, values set can't be empty")
                while True:
                    value = take_word("a label value")
                    _check_label_value(value)
                    values.append(value)
                    sep = take("',' or ')'")
                    if sep == ")":
                        break
                    if sep != ",":
                        raise SelectorError(f"{text!r}: expected ',' or ')', found {sep!r}")
                reqs.append(LabelRequirement(key, nxt, tuple(values)))
            else:
                raise SelectorError(f"{text!r}: unexpected {nxt!r} after key {key!r}")
        else:
            raise SelectorError(f"{text!r}: unexpected {tok!r}")
        sep_tok = peek()
        if sep_tok is None:
            return tuple(reqs)
        if sep_tok != ",":
            raise SelectorError(f"{text!r}: expected ',' between requirements, found {sep_tok!r}")
        pos += 1


def labels_match(reqs: tuple[LabelRequirement, ...], obj: JSON) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(req.matches(labels) for req in reqs)


@dataclass(frozen=True)
class FieldRequirement:
    path: tuple[str, ...]
    value: str
    equal: bool

    def matches(self, obj: JSON) -> bool:
        current: Any = obj
        for part in self.path:
            current = current.get(part) if isinstance(current, dict) else None
        actual = "" if current is None else str(current)
        return (actual == self.value) == self.equal


def parse_field_selector(text: str, rtype: ResourceType) -> tuple[FieldRequirement, ...]:
    reqs: list[FieldRequirement] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        for op in ("!=", "==", "="):
            key, found, value = term.partition(op)
            if found:
                break
        else:
            raise SelectorError(f"invalid field selector term {term!r}")
        key = key.strip()
        if key not in rtype.field_labels:
            raise SelectorError(f'field label not supported: {key}')
        reqs.append(FieldRequirement(rtype.field_labels[key], value.strip(), op != "!="))
    return tuple(reqs)


# ---------------------------------------------------------------------------------------------
# Patches
# ---------------------------------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (null deletes a key); also used for strategic merge on events."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _json_patch(target: JSON, ops: list[Any]) -> JSON:
    """RFC 6902 JSON patch, the add/remove/replace/test subset."""
    doc: Any = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "path" not in op or "op" not in op:
            raise FakeKubeError(400, f"invalid JSON patch operation {op!r}")
        parts = [p.replace("~1", "/").replace("~0", "~") for p in str(op["path"]).split("/")[1:]]
        if not parts:
            raise FakeKubeError(422, "JSON patch on the document root is not supported")
        parent: Any = doc
        try:
            for part in parts[:-1]:
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            last = parts[-1]
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if op["op"] == "add":
                    parent.insert(index, op["value"])
                elif op["op"] == "remove":
                    del parent[index]
                elif op["op"] == "replace":
                    parent[index] = op["value"]
                elif op["op"] == "test":
                    if parent[index] != op["value"]:
                        raise FakeKubeError(422, f"JSON patch test failed at {op['path']}")
                else:
                    raise FakeKubeError(422, f"JSON patch op {op['op']!r} not supported by the fake")
            else:
                if op["op"] == "add":
                    parent[last] = op["value"]
                elif op["op"] == "remove":
                    del parent[last]
                elif op["op"] == "replace":
                    if last not in parent:
                        raise KeyError(last)
                    parent[last] = op["value"]
                elif op["op"] == "test":
                    if parent.get(last) != op["value"]:
                        raise FakeKubeError(422, f"JSON patch test failed at {op['path']}")
                else:
                    raise FakeKubeError(422, f"JSON patch op {op['op']!r} not supported by the fake")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise FakeKubeError(422, f"JSON patch {op!r} failed: {exc!r}") from None
    if not isinstance(doc, dict):
        raise FakeKubeError(422, "JSON patch did not produce an object")
    return doc


# ---------------------------------------------------------------------------------------------
# Request log
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    """One HTTP request, described the way the apiserver's RBAC authorizer sees it."""
    verb: str                 # get/list/watch/create/update/patch/delete/deletecollection (or
    #                           the lower-cased HTTP method for non-resource paths)
    path: str
    query: dict[str, str]
    resource: str | None      # plural; None for non-resource paths
    namespace: str | None
    api_group: str            # "" for the core group
    subresource: str | None
    name: str | None
    watch: bool
    body: Any                 # parsed JSON, raw text if not JSON, None if empty
    method: str = ""          # HTTP method, for debugging


_TRUE_PARAM = re.compile(r"(?i)(1|t|true)")


def _bool_param(value: str | None) -> bool:
    # apiserver query booleans: strconv.ParseBool; "watch=1" and "watch=true" both mean yes.
    return value is not None and _TRUE_PARAM.fullmatch(value) is not None


@dataclass(frozen=True)
class _RequestInfo:
    is_resource: bool
    api_group: str = ""
    version: str = ""
    namespace: str | None = None
    resource: str | None = None
    name: str | None = None
    subresource: str | None = None
    verb: str = ""
    watch: bool = False
    malformed: bool = False


def _request_info(method: str, path: str, query: dict[str, str]) -> _RequestInfo:
    """Port of the relevant part of k8s.io/apiserver/pkg/endpoints/request.RequestInfoFactory."""
    parts = [unquote(p) for p in path.strip("/").split("/")] if path.strip("/") else []
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return _RequestInfo(is_resource=False, verb=method.lower())
    watch_prefix = bool(rest) and rest[0] == "watch"
    if watch_prefix:
        rest = rest[1:]
    if not rest:
        return _RequestInfo(is_resource=False, api_group=group, version=version, verb=method.lower())
    namespace = None
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2:
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else None
    watch = watch_prefix or _bool_param(query.get("watch"))
    if method in ("GET", "HEAD"):
        verb = "watch" if watch else ("get" if name else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete" if name else "deletecollection"}.get(method, method.lower())
    return _RequestInfo(True, group, version, namespace, resource, name, subresource, verb,
                        verb == "watch", malformed=len(rest) > 3)


# ---------------------------------------------------------------------------------------------
# Watches
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Change:
    rv: int
    type: str          # ADDED / MODIFIED / DELETED
    obj: JSON          # never mutated after commit
    prev: JSON | None  # state before a MODIFIED, to turn selector transitions into ADDED/DELETED


_END = "end"       # finish the stream cleanly (terminating chunk)
_BREAK = "break"   # drop the connection without the terminating chunk
_Item = JSON | str


class _Watcher:
    def __init__(self, rtype: ResourceType, namespace: str | None,
                 labels: tuple[LabelRequirement, ...], fields: tuple[FieldRequirement, ...],
                 bookmarks: bool) -> None:
        self.rtype = rtype
        self.namespace = namespace
        self.labels = labels
        self.fields = fields
        self.bookmarks = bookmarks
        self.queue: queue.Queue[_Item] = queue.Queue()

    def matches(self, obj: JSON) -> bool:
        if self.namespace is not None and (obj.get("metadata") or {}).get("namespace") != self.namespace:
            return False
        return labels_match(self.labels, obj) and all(f.matches(obj) for f in self.fields)

    def offer(self, change: _Change) -> None:
        # Like the apiserver's cacheWatcher: an object moving into / out of the selector is seen
        # as ADDED / DELETED by this watch.
        now = self.matches(change.obj)
        if change.type == "MODIFIED":
            before = change.prev is not None and self.matches(change.prev)
            kind = {(True, True): "MODIFIED", (False, True): "ADDED",
                    (True, False): "DELETED"}.get((before, now))
        else:
            kind = change.type if now else None
        if kind is not None:
            self.queue.put({"type": kind, "object": change.obj})


# ---------------------------------------------------------------------------------------------
# HTTP layer
# ---------------------------------------------------------------------------------------------

class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, fake: FakeKube) -> None:
        # The fake owns the listening socket and the accept loop (see FakeKube._serve), so the
        # server is only used for its per-connection handler threads.
        super().__init__(("127.0.0.1", 0), _Handler, bind_and_activate=False)
        self.socket.close()  # created by the base class, never bound or used
        self.fake = fake

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Connections cut by stop()/set_down()/break_watches() or by clients going away are
        # expected; anything else is a bug in the fake and should be loud.
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked encoding, like the apiserver
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature is inherited
        pass  # the structured request log is FakeKube.requests

    def finish(self) -> None:  # tracked by FakeKube._serve right after accept()
        try:
            super().finish()
        finally:
            self.server.fake._untrack(self.connection)

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_PATCH(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    # -- plumbing -------------------------------------------------------------------------------

    def _send_json(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            raise FakeKubeError(400, "chunked request bodies are not supported by the fake")
        length = self.headers.get("Content-Length")
        if not length:
            return b""
        try:
            size = int(length)
        except ValueError:
            self.close_connection = True
            raise FakeKubeError(400, f"bad Content-Length {length!r}") from None
        return self.rfile.read(size)

    def _dispatch(self) -> None:
        fake = self.server.fake
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        info = _request_info(self.command, split.path, query)
        body: Any = None
        body_error: FakeKubeError | None = None
        try:
            raw = self._read_body()
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = raw.decode("utf-8", errors="replace")
                    body_error = FakeKubeError(400, "request body is not valid JSON")
        except FakeKubeError as exc:
            body_error = exc
        fake._log(Request(info.verb, split.path, query, info.resource, info.namespace,
                          info.api_group, info.subresource, info.name, info.watch, body, self.command))
        self._streaming = False
        try:
            if body_error is not None:
                raise body_error
            self._route(fake, info, query, body)
        except FakeKubeError as exc:
            self._send_json(exc.code, exc.status())
        except OSError:
            raise  # connection cut; _Server.handle_error keeps quiet about it
        except Exception as exc:
            # A bug in the fake: say so loudly, and answer 500 rather than dropping the
            # connection (which urllib3 would silently retry).
            traceback.print_exc()
            self.close_connection = True
            if not self._streaming:
                self._send_json(500, status_body(500, f"FakeKube bug: {exc!r}"))

    def _route(self, fake: FakeKube, info: _RequestInfo, query: dict[str, str], body: Any) -> None:
        rtype = _resource_for(info.api_group, info.version, info.resource or "") if info.is_resource else None
        if (rtype is None or info.malformed
                or (info.namespace is not None and not rtype.namespaced)
                or (info.subresource is not None and not (info.subresource == "status" and rtype.has_status))):
            raise FakeKubeError(404, "the server could not find the requested resource")
        fake._take_failure(info.verb)
        ns = info.namespace
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if info.name is None:
            if self.command == "GET" and info.watch:
                self._stream_watch(fake, rtype, ns, query)
            elif self.command == "GET":
                self._send_json(200, fake._list(rtype, ns, query))
            elif self.command == "POST":
                if rtype.namespaced and ns is None:
                    raise FakeKubeError(404, "the server could not find the requested resource")
                self._send_json(201, fake._create(rtype, _need_object(body), ns, http=True))
            else:
                raise FakeKubeError(405, f"{self.command} is not supported on a collection by the fake")
            return
        if rtype.namespaced and ns is None:
            raise FakeKubeError(404, "the server could not find the requested resource")
        status_only = info.subresource == "status"
        if self.command == "GET" and info.watch:
            # GET .../watch/<plural>/<name>: a watch narrowed to one object.
            self._stream_watch(fake, rtype, ns, {**query, "fieldSelector": _and_name(query, info.name)})
        elif self.command == "GET":
            self._send_json(200, fake._get(rtype, info.name, ns))
        elif self.command == "PUT":
            obj = _need_object(body)
            if (obj.get("metadata") or {}).get("name") not in (None, info.name):
                raise FakeKubeError(400, "the name of the object does not match the name on the URL")
            obj.setdefault("metadata", {})["name"] = info.name
            self._send_json(200, fake._update(rtype, obj, ns, mode="status" if status_only else "main"))
        elif self.command == "PATCH":
            self._send_json(200, fake._patch_http(rtype, info.name, ns, content_type, body, status_only))
        elif self.command == "DELETE" and not status_only:
            deleted = fake._delete(rtype, info.name, ns)
            if rtype.group:
                # Custom resources come back as the deleted object; built-ins like Event as Status.
                self._send_json(200, deleted)
            else:
                self._send_json(200, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                      "status": "Success",
                                      "details": {"name": info.name, "kind": rtype.plural,
                                                  "uid": deleted["metadata"].get("uid")}})
        else:
            raise FakeKubeError(405, f"{self.command} is not supported here by the fake")

    # -- watch ----------------------------------------------------------------------------------

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _client_gone(self) -> bool:
        # A watch client that hung up shows as a readable socket with nothing to read.
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _stream_watch(self, fake: FakeKube, rtype: ResourceType, ns: str | None,
                      query: dict[str, str]) -> None:
        timeout_s: float | None = None
        if query.get("timeoutSeconds"):
            try:
                timeout_s = float(int(query["timeoutSeconds"]))
            except ValueError:
                raise FakeKubeError(400, f"invalid timeoutSeconds {query['timeoutSeconds']!r}") from None
        watcher = fake._open_watch(rtype, ns, query)  # may raise 400 before any header is sent
        clean = False
        self._streaming = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Cache-Control", "no-cache, private")
            self.end_headers()
            start = time.monotonic()
            deadline = start + timeout_s if timeout_s is not None else None
            interval = fake.bookmark_interval if watcher.bookmarks else None
            next_bookmark = start + interval if interval else None
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    item: _Item = _END  # server-side timeoutSeconds: a clean end, like the apiserver
                else:
                    if next_bookmark is not None and interval and now >= next_bookmark:
                        fake._bookmark_one(watcher)  # queued, so it follows any pending events
                        next_bookmark = now + interval
                    wait = 0.25  # also how often a vanished client is noticed
                    for limit in (deadline, next_bookmark):
                        if limit is not None:
                            wait = min(wait, max(limit - now, 0.0))
                    try:
                        item = watcher.queue.get(timeout=wait)
                    except queue.Empty:
                        if self._client_gone():
                            break
                        continue
                if item in (_END, _BREAK):
                    # Unregister first: once the client sees the end, the watch must not count
                    # as open (tests wait on open_watches() for the client's next watch).
                    fake._close_watch(watcher)
                if item == _END:
                    self.wfile.write(b"0\r\n\r\n")
                    clean = True
                    break
                if item == _BREAK:
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # already gone
                    break
                assert isinstance(item, dict)
                self._write_chunk(json.dumps(item).encode() + b"\n")
        except OSError:
            pass  # client went away mid-write; nothing to tell it
        finally:
            fake._close_watch(watcher)
            if not clean:
                self.close_connection = True


def _need_object(body: Any) -> JSON:
    if not isinstance(body, dict):
        raise FakeKubeError(400, "request body must be a JSON object")
    if not isinstance(body.get("metadata", {}), dict):
        raise FakeKubeError(400, "metadata must be a JSON object")
    return body


def _and_name(query: dict[str, str], name: str) -> str:
    existing = query.get("fieldSelector", "")
    return f"{existing},metadata.name={name}" if existing else f"metadata.name={name}"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _bind_loopback() -> socket.socket:
    # Bind an explicit port (found by probing port 0) rather than port 0 itself: Linux releases
    # an auto-assigned port when a listener is shut down, and set_down()/set_down(False) rely on
    # shutdown()+listen() keeping the same port.
    last: OSError | None = None
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:  # raced with someone else for that port; probe again
            sock.close()
            last = exc
            continue
        return sock
    raise OSError(f"could not bind a loopback port: {last}")


# ---------------------------------------------------------------------------------------------
# The fake
# ---------------------------------------------------------------------------------------------

class FakeKube:
    """A fake Kubernetes API server for ``iptables-dnat-rules``, ``iptables-eips`` and events.

    ``sock``: an already-bound TCP socket to serve on (it may live in another network namespace);
    it is put into listening state. It must be bound to an explicit port if ``set_down()`` is
    used (see there). Without it, a loopback port on 127.0.0.1 is chosen.
    ``bookmark_interval``: seconds between automatic BOOKMARKs on watches that asked for them;
    None sends them only when ``bookmark()`` is called.
    ``history_limit``: changes kept per resource for watch replay; older ones are forgotten and
    a watch from before them gets 410 Expired, as after ``compact()``.
    """

    def __init__(self, sock: socket.socket | None = None, *, bookmark_interval: float | None = None,
                 history_limit: int = 1000) -> None:
        self.bookmark_interval = bookmark_interval
        self._history_limit = history_limit
        self._lock = threading.RLock()
        self._rv = 1  # like a fresh etcd; the first write gets "2"
        self._objects: dict[str, dict[tuple[str, str], JSON]] = {p: {} for p in RESOURCES}
        self._history: dict[str, deque[_Change]] = {p: deque() for p in RESOURCES}
        self._floor: dict[str, int] = {p: 0 for p in RESOURCES}  # watch rv below this -> 410
        self._watchers: set[_Watcher] = set()
        self._requests: list[Request] = []
        self._failures: dict[str, deque[int]] = {}
        self._conns: set[socket.socket] = set()
        self._sock = sock if sock is not None else _bind_loopback()
        host, port = self._sock.getsockname()[:2]
        self._port: int = port
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        self._url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self._server = _Server(self)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._up = threading.Event()
        self._up.set()
        # Wakes the accept loop at once on stop()/set_down() instead of waiting for a poll tick.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._state_lock = threading.Lock()  # serialises start/stop/set_down

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._url

    def start(self) -> FakeKube:
        with self._state_lock:
            if self._thread is not None:
                raise RuntimeError("FakeKube already started")
            self._sock.listen(128)
            self._sock.setblocking(False)  # accept() after select() must not hang if shut down
            self._thread = threading.Thread(target=self._serve, name=f"fakekube:{self._port}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: end open watches (abruptly), drop connections, close the socket."""
        with self._state_lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self._up.set()
            self.break_watches()
            self._drop_connections()
            self._wake()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()  # after the loop has left select(), so no fd is closed under it

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # buffer full: the loop is awake anyway

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except BlockingIOError:
            pass  # drained

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping.is_set():
                if not self._up.is_set():
                    self._up.wait(0.5)
                    continue
                try:
                    ready = [key.fileobj for key, _ in sel.select(0.5)]
                    if self._wake_r in ready:
                        self._drain_wake()
                    if self._sock not in ready or not self._up.is_set():
                        continue
                    conn, addr = self._sock.accept()
                except OSError:
                    # Shut down by set_down()/stop() under us (EINVAL), or a spurious wakeup.
                    if not self._up.is_set() or self._stopping.is_set():
                        continue
                    time.sleep(0.01)  # unexpected; do not spin
                    continue
                conn.setblocking(True)
                # Track before anything else so set_down()/stop() cannot miss this connection:
                # they mark the fake down first and then cut tracked connections.
                self._track(conn)
                if not self._up.is_set() or self._stopping.is_set():
                    self._untrack(conn)
                    conn.close()
                    continue
                self._server.process_request(conn, addr)

    def _track(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)

    def _untrack(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _drop_connections(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its handler

    # -- failure injection ----------------------------------------------------------------------

    def set_down(self, down: bool) -> None:
        """Refuse service (connection refused) while down; serve again on the same port when up.

        Down: the listening socket is shut down (Linux stops listening, so connects get
        ECONNREFUSED), every open connection, keep-alive or watch, is cut without a terminating
        chunk. Up: the same socket listens again, so the URL stays valid. This works on a
        caller-provided socket too, but only if it was bound to an explicit port: Linux gives
        back a port that was auto-assigned (bind to port 0) when the listener is shut down, and
        then ``set_down(False)`` raises RuntimeError.
        """
        with self._state_lock:
            if self._stopping.is_set():
                raise RuntimeError("FakeKube is stopped")
            if down and self._up.is_set():
                self._up.clear()
                self._sock.shutdown(socket.SHUT_RDWR)
                self._wake()
                self.break_watches()
                self._drop_connections()
            elif not down and not self._up.is_set():
                self._sock.listen(128)
                port = self._sock.getsockname()[1]
                if port != self._port:
                    raise RuntimeError(f"listening socket came back on port {port}, not {self._port}: "
                                       "bind caller sockets to an explicit port to use set_down()")
                self._up.set()

    def fail_next(self, n: int, status: int = 500, verb: str = "list") -> None:
        """Answer the next ``n`` requests with RBAC verb ``verb`` (default list) with a Status error."""
        with self._lock:
            self._failures.setdefault(verb, deque()).extend([status] * n)

    def _take_failure(self, verb: str) -> None:
        with self._lock:
            pending = self._failures.get(verb)
            status = pending.popleft() if pending else None
        if status is not None:
            raise FakeKubeError(status, f"injected failure for {verb} (FakeKube.fail_next)")

    def break_watches(self, plural: str | None = None) -> int:
        """Cut open watch connections without the terminating chunk (events already queued to a
        watch are still written first). Returns how many watches were broken."""
        return self._push(plural, _BREAK)

    def end_watches(self, plural: str | None = None) -> int:
        """End open watch streams cleanly, as the apiserver does when its timeout expires."""
        return self._push(plural, _END)

    def send_raw(self, plural: str, line: JSON) -> int:
        """Push an arbitrary event object to every open watch of ``plural`` (no filtering)."""
        _rtype(plural)
        return self._push(plural, copy.deepcopy(line))

    def _push(self, plural: str | None, item: _Item) -> int:
        with self._lock:
            targets = [w for w in self._watchers if plural is None or w.rtype.plural == plural]
            for watcher in targets:
                watcher.queue.put(item)
        return len(targets)

    def bookmark(self, plural: str | None = None) -> int:
        """Send a BOOKMARK with the current resourceVersion to watches that allowed bookmarks."""
        with self._lock:
            targets = [w for w in self._watchers
                       if w.bookmarks and (plural is None or w.rtype.plural == plural)]
            for watcher in targets:
                self._bookmark_one(watcher)
        return len(targets)

    def _bookmark_one(self, watcher: _Watcher) -> None:
        with self._lock:  # rv read and enqueue together, so the bookmark never overtakes an event
            watcher.queue.put({"type": "BOOKMARK", "object": {
                "kind": watcher.rtype.kind, "apiVersion": watcher.rtype.api_version,
                "metadata": {"resourceVersion": str(self._rv)}}})

    def compact(self) -> None:
        """Forget all history up to now, like etcd compaction: watches from older resourceVersions
        get a 410 Expired ERROR event."""
        with self._lock:
            for plural in RESOURCES:
                self._history[plural].clear()
                self._floor[plural] = self._rv

    # -- observation ----------------------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    def _log(self, req: Request) -> None:
        with self._lock:
            self._requests.append(req)

    @property
    def resource_version(self) -> str:
        with self._lock:
            return str(self._rv)

    def open_watches(self, plural: str | None = None) -> int:
        with self._lock:
            return sum(1 for w in self._watchers if plural is None or w.rtype.plural == plural)

    def wait_for_watches(self, n: int, plural: str | None = None, timeout: float = 5.0) -> None:
        """Block until exactly ``n`` watches (of ``plural``) are open server-side."""
        _wait(lambda: self.open_watches(plural) == n, timeout,
              lambda: f"expected {n} open watches of {plural or 'any resource'}, "
                      f"have {self.open_watches(plural)}")

    # -- store: fixture API ---------------------------------------------------------------------

    def create(self, plural: str, obj: JSON, namespace: str | None = None) -> JSON:
        return self._create(_rtype(plural), copy.deepcopy(obj), namespace, http=False)

    def update(self, plural: str, obj: JSON, namespace: str | None = None) -> JSON:
        """Replace the object (status included); a stale metadata.resourceVersion -> 409."""
        return self._update(_rtype(plural), copy.deepcopy(obj), namespace, mode="all")

    def patch(self, plural: str, name: str, merge: JSON, namespace: str | None = None) -> JSON:
        """JSON-merge-patch the object (status included)."""
        rtype = _rtype(plural)
        with self._lock:
            current = self._get(rtype, name, self._default_ns(rtype, namespace))
            return self._update(rtype, merge_patch(current, merge), namespace, mode="all")

    def delete(self, plural: str, name: str, namespace: str | None = None) -> JSON:
        return self._delete(_rtype(plural), name, namespace)

    def get(self, plural: str, name: str, namespace: str | None = None) -> JSON:
        rtype = _rtype(plural)
        return self._get(rtype, name, self._default_ns(rtype, namespace))

    def objects(self, plural: str, namespace: str | None = None) -> list[JSON]:
        _rtype(plural)  # unknown plural -> ValueError rather than KeyError
        with self._lock:
            items = [o for (ns, _), o in sorted(self._objects[plural].items())
                     if namespace is None or ns == namespace]
            return copy.deepcopy(items)

    # -- store: internals -----------------------------------------------------------------------

    @staticmethod
    def _default_ns(rtype: ResourceType, namespace: str | None) -> str | None:
        if not rtype.namespaced:
            return None
        return namespace or "default"

    @staticmethod
    def _key(rtype: ResourceType, obj: JSON) -> tuple[str, str]:
        meta = obj["metadata"]
        return (meta.get("namespace", "") if rtype.namespaced else "", meta["name"])

    def _check_type(self, rtype: ResourceType, obj: JSON) -> None:
        for key, want in (("apiVersion", rtype.api_version), ("kind", rtype.kind)):
            if obj.get(key) not in (None, "", want):
                raise FakeKubeError(400, f"{key} {obj.get(key)!r} does not match {want!r} for {rtype.plural}")
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind

    def _place(self, rtype: ResourceType, meta: JSON, namespace: str | None, http: bool) -> None:
        if not rtype.namespaced:
            meta.pop("namespace", None)  # the apiserver drops it for cluster-scoped objects
            return
        if http and meta.get("namespace") not in (None, "", namespace):
            raise FakeKubeError(400, "the namespace of the provided object does not match the "
                                     "namespace sent on the request")
        meta["namespace"] = namespace or meta.get("namespace") or "default"

    def _commit(self, rtype: ResourceType, kind: str, obj: JSON, prev: JSON | None) -> JSON:
        """Assign the next resourceVersion, store, record history and notify watches (locked)."""
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = self._key(rtype, obj)
        if kind == "DELETED":
            self._objects[rtype.plural].pop(key, None)
        else:
            self._objects[rtype.plural][key] = obj
        change = _Change(self._rv, kind, obj, prev)
        history = self._history[rtype.plural]
        history.append(change)
        while len(history) > self._history_limit:
            self._floor[rtype.plural] = history.popleft().rv
        for watcher in self._watchers:
            if watcher.rtype is rtype:
                watcher.offer(change)
        return copy.deepcopy(obj)

    def _create(self, rtype: ResourceType, obj: JSON, namespace: str | None, *, http: bool) -> JSON:
        self._check_type(rtype, obj)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise FakeKubeError(400, "metadata must be an object")
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise FakeKubeError(422, "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + "".join(
                secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
        self._place(rtype, meta, namespace, http)
        if http and rtype.has_status:
            obj.pop("status", None)  # status subresource: create ignores status
        with self._lock:
            key = self._key(rtype, obj)
            if key in self._objects[rtype.plural]:
                raise FakeKubeError(409, f'{rtype.qualified} "{meta["name"]}" already exists',
                                    reason="AlreadyExists",
                                    details={"name": meta["name"], "group": rtype.group, "kind": rtype.plural})
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now()
            if rtype.group:
                meta["generation"] = 1
            for gone in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(gone, None)
            return self._commit(rtype, "ADDED", obj, None)

    def _update(self, rtype: ResourceType, obj: JSON, namespace: str | None, *, mode: str) -> JSON:
        """mode: "all" (fixture), "main" (PUT/PATCH on the object), "status" (the /status subresource)."""
        self._check_type(rtype, obj)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict) or not meta.get("name"):
            raise FakeKubeError(422, "metadata.name: Required value")
        self._place(rtype, meta, namespace, http=mode != "all")
        with self._lock:
            key = self._key(rtype, obj)
            current = self._objects[rtype.plural].get(key)
            if current is None:
                raise _not_found(rtype, meta["name"])
            cur_meta = current["metadata"]
            if meta.get("resourceVersion") not in (None, "", cur_meta["resourceVersion"]):
                raise FakeKubeError(
                    409, f'Operation cannot be fulfilled on {rtype.qualified} "{meta["name"]}": the '
                         "object has been modified; please apply your changes to the latest version "
                         "and try again",
                    details={"name": meta["name"], "group": rtype.group, "kind": rtype.plural})
            if mode == "status":
                new = copy.deepcopy(current)
                if "status" in obj:
                    new["status"] = obj["status"]
                else:
                    new.pop("status", None)
            else:
                new = obj
                if mode == "main" and rtype.has_status:
                    # status subresource: the main resource endpoint keeps the stored status
                    new.pop("status", None)
                    if "status" in current:
                        new["status"] = copy.deepcopy(current["status"])
            new_meta = new["metadata"]
            for kept in ("uid", "creationTimestamp", "generation"):
                if kept in cur_meta:
                    new_meta[kept] = cur_meta[kept]
                else:
                    new_meta.pop(kept, None)
            if rtype.group and _spec_of(new) != _spec_of(current):
                new_meta["generation"] = cur_meta.get("generation", 0) + 1
            return self._commit(rtype, "MODIFIED", new, current)

    def _patch_http(self, rtype: ResourceType, name: str, namespace: str | None, content_type: str,
                    body: Any, status_only: bool) -> JSON:
        with self._lock:
            current = self._get(rtype, name, namespace)
            if content_type == "application/json-patch+json":
                if not isinstance(body, list):
                    raise FakeKubeError(400, "a JSON patch must be a list of operations")
                patched = _json_patch(current, body)
            elif content_type == "application/merge-patch+json" or (
                    content_type == "application/strategic-merge-patch+json" and not rtype.group):
                # Strategic merge is approximated by a merge patch: good enough for events.
                patched = merge_patch(current, _need_object(body))
            else:
                # Real apiservers answer 415 to strategic merge on custom resources too.
                raise FakeKubeError(415, f"the body of the request was in an unknown format - "
                                         f"accepted media types for {rtype.qualified} by the fake: "
                                         "application/json-patch+json, application/merge-patch+json"
                                         + ("" if rtype.group else ", application/strategic-merge-patch+json"))
            patched.setdefault("metadata", {})["name"] = name
            return self._update(rtype, patched, namespace, mode="status" if status_only else "main")

    def _delete(self, rtype: ResourceType, name: str, namespace: str | None) -> JSON:
        with self._lock:
            ns = self._default_ns(rtype, namespace)
            current = self._objects[rtype.plural].get((ns or "", name))
            if current is None:
                raise _not_found(rtype, name)
            return self._commit(rtype, "DELETED", copy.deepcopy(current), None)

    def _get(self, rtype: ResourceType, name: str, namespace: str | None) -> JSON:
        with self._lock:
            obj = self._objects[rtype.plural].get((namespace or "", name))
            if obj is None:
                raise _not_found(rtype, name)
            return copy.deepcopy(obj)

    @staticmethod
    def _selectors(rtype: ResourceType, query: dict[str, str]
                   ) -> tuple[tuple[LabelRequirement, ...], tuple[FieldRequirement, ...]]:
        try:
            return (parse_label_selector(query.get("labelSelector", "")),
                    parse_field_selector(query.get("fieldSelector", ""), rtype))
        except SelectorError as exc:
            raise FakeKubeError(400, f"unable to parse requirement: {exc}") from None

    def _list(self, rtype: ResourceType, namespace: str | None, query: dict[str, str]) -> JSON:
        labels, fields = self._selectors(rtype, query)
        probe = _Watcher(rtype, namespace, labels, fields, False)  # reused for its filter
        with self._lock:
            items = [copy.deepcopy(o) for _, o in sorted(self._objects[rtype.plural].items())
                     if probe.matches(o)]
            rv = str(self._rv)
        return {"apiVersion": rtype.api_version, "kind": rtype.list_kind,
                "metadata": {"resourceVersion": rv}, "items": items}

    def _open_watch(self, rtype: ResourceType, namespace: str | None, query: dict[str, str]) -> _Watcher:
        labels, fields = self._selectors(rtype, query)
        watcher = _Watcher(rtype, namespace, labels, fields, _bool_param(query.get("allowWatchBookmarks")))
        rv_text = query.get("resourceVersion", "")
        start: int | None = None
        if rv_text not in ("", "0"):
            try:
                start = int(rv_text)
            except ValueError:
                raise FakeKubeError(400, f"invalid resourceVersion {rv_text!r}") from None
        with self._lock:
            # Backlog and registration happen under the store lock, so no change is missed or doubled.
            if start is None:
                # "" / "0": synthetic ADDED for the current state, then live events.
                for _, obj in sorted(self._objects[rtype.plural].items()):
                    if watcher.matches(obj):
                        watcher.queue.put({"type": "ADDED", "object": obj})
            elif start < self._floor[rtype.plural]:
                watcher.queue.put({"type": "ERROR", "object": status_body(
                    410, f"too old resource version: {start} ({self._floor[rtype.plural]})", "Expired")})
                watcher.queue.put(_END)
                return watcher  # not registered: this stream carries the error and ends
            else:
                for change in self._history[rtype.plural]:
                    if change.rv > start:
                        watcher.offer(change)
            self._watchers.add(watcher)
        return watcher

    def _close_watch(self, watcher: _Watcher) -> None:
        with self._lock:
            self._watchers.discard(watcher)


def _spec_of(obj: JSON) -> JSON:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _wait(cond: Callable[[], bool], timeout: float, describe: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise TimeoutError(describe())
        time.sleep(0.01)
