"""The fake API server (tests/kubefake/) driven by the real ``kubernetes`` client.

These tests double as documentation of how the installed client (kubernetes 37.x, urllib3 2.x)
surfaces watch-level events, because the agent has to handle exactly these:

* 410 Expired (watch from a compacted resourceVersion): the server sends an ERROR event;
  ``Watch.stream`` raises ``kubernetes.client.exceptions.ApiException`` with ``status == 410``,
  ``reason == "Expired: too old resource version: X (Y)"``, ``body is None``. With
  ``timeout_seconds`` the client raises at once; without it, it silently retries ONCE from its
  last known resourceVersion and raises on the second 410 (two watch requests).
* ERROR events with any other code raise ``ApiException`` with that code straight away.
* A broken watch connection (no terminating chunk) raises
  ``urllib3.exceptions.ProtocolError("Response ended prematurely")`` out of the generator,
  with or without ``timeout_seconds``; the client never retries that by itself.
* A clean end of the stream (server-side timeout): the generator just ends if
  ``timeout_seconds`` was passed; without it, the client re-issues the watch from its last
  resourceVersion by itself and the caller sees nothing.
* BOOKMARK events are yielded to the caller (``object`` is the raw dict, not deserialized) and
  ``Watch.resource_version`` is set to the bookmark's resourceVersion.
* Unknown event types (e.g. "WEIRD") are yielded as-is with ``object`` a dict.
* An idle watch read with a client ``_request_timeout=(connect, read)`` raises
  ``urllib3.exceptions.ReadTimeoutError`` after ``read`` seconds without data. The apiserver
  sends nothing on an idle watch except BOOKMARKs (about once a minute when allowed); the fake
  sends them only with ``bookmark_interval`` or ``bookmark()``.
* Connection refused: ``urllib3.exceptions.MaxRetryError`` (``reason`` is a
  ``NewConnectionError``) after urllib3's 3 immediate retries; not an ApiException.
* HTTP errors on plain requests: ``ApiException`` subclasses by status, e.g. 500 ->
  ``ServiceException``, 400 -> ``BadRequestException``, 404 -> ``NotFoundException``, with the
  Status JSON in ``.body``; a 410 on a list is the base ``ApiException`` with ``status == 410``.
* Paginated lists: ``limit=`` and ``_continue=`` (the keyword has an underscore); the page's
  ``metadata`` carries ``continue`` and ``remainingItemCount`` while items remain.
"""
from __future__ import annotations

import base64
import copy
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import (ApiException, BadRequestException, NotFoundException,
                                          ServiceException)

from tests.kubefake import FakeKube

G, V = "kubeovn.io", "v1"
RULES, EIPS = "iptables-dnat-rules", "iptables-eips"
WATCH_TIMEOUT = 5  # server-side timeoutSeconds: bounds every watch even if a test goes wrong


def rule(name: str, port: str = "80") -> dict[str, Any]:
    return {"apiVersion": "kubeovn.io/v1", "kind": "IptablesDnatRule", "metadata": {"name": name},
            "spec": {"eip": "eip-web", "externalPort": port, "protocol": "tcp",
                     "internalIp": "10.0.1.11", "internalPort": "8080"}}


def changed(fake: FakeKube, name: str, **spec: str) -> dict[str, Any]:
    """Update a rule's spec in the fake (the fixture path: no HTTP)."""
    obj = copy.deepcopy(fake.get(RULES, name))
    obj["spec"].update(spec)
    return fake.update(RULES, obj)


def as_dict(value: object) -> dict[str, Any]:
    """CustomObjectsApi is declared to return ``object``; it is a dict for JSON responses."""
    assert isinstance(value, dict), value
    return value


def status_of(exc: ApiException) -> dict[str, Any]:
    """The metav1.Status the server sent with an error response."""
    return as_dict(json.loads(exc.body or "null"))


def stream(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """``Watch().stream`` in the calling thread (the library itself is untyped)."""
    w = watch.Watch()  # type: ignore[no-untyped-call]
    events: Iterator[dict[str, Any]] = w.stream(func, *args, **kwargs)  # type: ignore[no-untyped-call]
    return events


def wait_until(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class WatchThread:
    """Runs ``Watch().stream(...)`` in a daemon thread and records what it yields or raises."""

    def __init__(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.watch = watch.Watch()  # type: ignore[no-untyped-call]
        self.events: list[dict[str, Any]] = []
        self.error: Exception | None = None
        self.done = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(func, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            for event in self.watch.stream(func, *args, **kwargs):  # type: ignore[no-untyped-call]
                with self._cond:
                    self.events.append(event)
                    self._cond.notify_all()
        except Exception as exc:  # recorded for the test to assert on
            self.error = exc
        finally:
            self.done.set()
            with self._cond:
                self._cond.notify_all()

    def wait_events(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.events) >= n or self.done.is_set(), timeout)
            assert ok and len(self.events) >= n, \
                f"wanted {n} events, got {[e['type'] for e in self.events]} (error={self.error!r})"
            return list(self.events[:n])

    def wait_done(self, timeout: float = 5.0) -> None:
        assert self.done.wait(timeout), "watch stream did not end"


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube() as fk:
        yield fk


def make_api_client(url: str) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = url
    # Setting proxy explicitly stops Configuration from taking http_proxy from the environment.
    cfg.proxy = None
    return client.ApiClient(cfg)


@pytest.fixture
def api_client(fake: FakeKube) -> Iterator[client.ApiClient]:
    with make_api_client(fake.url) as api:
        yield api


@pytest.fixture
def crd(api_client: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client)


def watch_rules(crd: client.CustomObjectsApi, **kwargs: Any) -> WatchThread:
    kwargs.setdefault("timeout_seconds", WATCH_TIMEOUT)
    return WatchThread(crd.list_cluster_custom_object, G, V, RULES, **kwargs)


# ---------------------------------------------------------------------------------------------
# list
# ---------------------------------------------------------------------------------------------

def test_list_carries_resource_versions(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    a = fake.create(RULES, rule("web-a"))
    b = fake.create(RULES, rule("web-b"))
    fake.create(EIPS, {"metadata": {"name": "eip-web"}, "spec": {"v4ip": "172.18.0.10"}})

    listed = as_dict(crd.list_cluster_custom_object(G, V, RULES))
    assert listed["apiVersion"] == "kubeovn.io/v1"
    assert listed["kind"] == "IptablesDnatRuleList"
    assert listed["metadata"]["resourceVersion"] == fake.resource_version  # global, includes the EIP
    assert [i["metadata"]["name"] for i in listed["items"]] == ["web-a", "web-b"]
    assert int(a["metadata"]["resourceVersion"]) < int(b["metadata"]["resourceVersion"])
    assert listed["items"][0]["kind"] == "IptablesDnatRule"
    assert listed["items"][0]["metadata"]["uid"] == a["metadata"]["uid"]
    assert listed["items"][1]["metadata"]["resourceVersion"] == b["metadata"]["resourceVersion"]
    assert "continue" not in listed["metadata"] and "remainingItemCount" not in listed["metadata"]
    eips = as_dict(crd.list_cluster_custom_object(G, V, EIPS))
    assert eips["kind"] == "IptablesEIPList" and eips["items"][0]["kind"] == "IptablesEIP"


def page(crd: client.CustomObjectsApi, **kwargs: Any) -> dict[str, Any]:
    return as_dict(crd.list_cluster_custom_object(G, V, RULES, **kwargs))


def names(listed: dict[str, Any]) -> list[str]:
    return [i["metadata"]["name"] for i in listed["items"]]


def token(content: object) -> str:
    """A continue token as the API server encodes one: unpadded URL-safe base64 of Go's JSON."""
    return base64.urlsafe_b64encode(json.dumps(content, separators=(",", ":")).encode()).decode().rstrip("=")


def test_paginated_list_serves_every_page_at_the_first_pages_version(
        fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    for name in ("web-a", "web-b", "web-c", "web-d", "web-e"):
        fake.create(RULES, rule(name))
    first = page(crd, limit=2)
    rv = first["metadata"]["resourceVersion"]
    assert rv == fake.resource_version
    assert names(first) == ["web-a", "web-b"] and first["metadata"]["remainingItemCount"] == 3
    # The list's version and the key right after the last one returned.
    assert first["metadata"]["continue"] == token({"v": "meta.k8s.io/v1", "rv": int(rv), "start": "web-b\x00"})

    # The world changes between pages; the list does not.
    fake.delete(RULES, "web-c")
    changed(fake, "web-d", externalPort="81")
    fake.create(RULES, rule("web-bb"))  # would sort into the pages still to come
    second = page(crd, limit=2, _continue=first["metadata"]["continue"])
    assert names(second) == ["web-c", "web-d"] and second["items"][1]["spec"]["externalPort"] == "80"
    assert second["metadata"]["resourceVersion"] == rv and second["metadata"]["remainingItemCount"] == 1
    last = page(crd, limit=2, _continue=second["metadata"]["continue"])
    assert names(last) == ["web-e"] and last["metadata"]["resourceVersion"] == rv
    assert "continue" not in last["metadata"] and "remainingItemCount" not in last["metadata"]

    fresh = page(crd)  # a new list sees the world of now
    assert names(fresh) == ["web-a", "web-b", "web-bb", "web-d", "web-e"]
    assert fresh["metadata"]["resourceVersion"] == fake.resource_version != rv
    assert [r.query.get("limit") for r in fake.requests] == ["2", "2", "2", None]


def test_a_limit_that_covers_the_rest_ends_the_list(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    for name in ("a", "b", "c"):
        fake.create(RULES, rule(name))
    whole = page(crd, limit=3)
    assert names(whole) == ["a", "b", "c"] and "continue" not in whole["metadata"]
    rest = page(crd, limit=5, _continue=page(crd, limit=1)["metadata"]["continue"])
    assert names(rest) == ["b", "c"] and "continue" not in rest["metadata"]
    empty = as_dict(crd.list_cluster_custom_object(G, V, EIPS, limit=1))
    assert empty["items"] == [] and "continue" not in empty["metadata"]


def test_continue_from_a_compacted_version_is_410_expired(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    for name in ("a", "b", "c"):
        fake.create(RULES, rule(name))
    first = page(crd, limit=1)
    fake.delete(RULES, "b")
    fake.create(RULES, rule("bb"))
    fake.compact()
    with pytest.raises(ApiException) as err:
        page(crd, limit=1, _continue=first["metadata"]["continue"])
    assert type(err.value) is ApiException and err.value.status == 410
    body = status_of(err.value)
    assert (body["kind"], body["code"], body["reason"]) == ("Status", 410, "Expired")
    assert body["message"].startswith("The provided continue parameter is too old to display a consistent list")
    # Like the API server's, the error carries a token that goes on at the latest version from
    # where the list stopped: the rest of an inconsistent list.
    assert body["metadata"]["continue"] == token({"v": "meta.k8s.io/v1", "rv": -1, "start": "a\x00"})
    rest = page(crd, _continue=body["metadata"]["continue"])
    assert names(rest) == ["bb", "c"] and rest["metadata"]["resourceVersion"] == fake.resource_version


@pytest.mark.parametrize(("bad", "why"), [
    ("%%%", "Only base64 data is allowed"),
    (token({"v": "meta.k8s.io/v2", "rv": 5, "start": "a"}), "server does not recognize this encoded version"),
    (token({"v": "meta.k8s.io/v1", "rv": 0, "start": "a"}), "incorrect encoded start resourceVersion"),
    (token({"v": "meta.k8s.io/v1", "rv": 5, "start": ""}), "encoded start key empty"),
    (token({"v": "meta.k8s.io/v1", "rv": 5, "start": "../events/x"}), "../events/x"),
])
def test_bad_continue_tokens_are_400(fake: FakeKube, crd: client.CustomObjectsApi, bad: str, why: str) -> None:
    with pytest.raises(BadRequestException) as err:
        page(crd, limit=1, _continue=bad)
    message = status_of(err.value)["message"]
    assert message.startswith("invalid continue token: continue key is not valid") and why in message


def test_a_continued_list_takes_no_resource_version(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    fake.create(RULES, rule("a"))
    fake.create(RULES, rule("b"))
    next_page = page(crd, limit=1)["metadata"]["continue"]
    with pytest.raises(BadRequestException) as err:
        page(crd, _continue=next_page, resource_version="3")
    assert status_of(err.value)["message"] == "specifying resource version is not allowed when using continue"
    assert names(page(crd, _continue=next_page, resource_version="0")) == ["b"]
    with pytest.raises(BadRequestException):  # and the fake lists only at the latest version
        page(crd, resource_version="3")


# ---------------------------------------------------------------------------------------------
# customresourcedefinitions
# ---------------------------------------------------------------------------------------------

def crd_of(plural: str, kind: str) -> dict[str, Any]:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{G}"},
            "spec": {"group": G, "scope": "Cluster",
                     "names": {"plural": plural, "kind": kind, "listKind": kind + "List"},
                     "versions": [{"name": V, "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def test_crds_set_by_the_test_are_served_by_name(fake: FakeKube, api_client: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(api_client)
    name = f"{RULES}.{G}"
    served = ext.read_custom_resource_definition(name)  # from the start, as in a cluster with kube-ovn
    assert {"type", "sessionAffinity"} <= set(served.spec.versions[0].schema.open_apiv3_schema.properties["spec"].properties)
    fake.delete("customresourcedefinitions", name)
    with pytest.raises(NotFoundException) as err:
        ext.read_custom_resource_definition(name)
    body = status_of(err.value)
    assert body["message"] == f'customresourcedefinitions.apiextensions.k8s.io "{name}" not found'
    assert body["details"] == {"name": name, "group": "apiextensions.k8s.io", "kind": "customresourcedefinitions"}

    stored = fake.set_crd(crd_of(RULES, "IptablesDnatRule"))
    fake.set_crd(crd_of(EIPS, "IptablesEIP"))
    got = ext.read_custom_resource_definition(name)
    assert isinstance(got, client.V1CustomResourceDefinition) and got.spec.names.kind == "IptablesDnatRule"
    assert got.spec.scope == "Cluster" and got.spec.versions[0].name == V
    assert (got.metadata.uid, got.metadata.resource_version) == (
        stored["metadata"]["uid"], stored["metadata"]["resourceVersion"])

    again = crd_of(RULES, "IptablesDnatRule")
    again["spec"]["names"]["shortNames"] = ["dnat"]
    fake.set_crd(again)  # replaced: a new version, the same object
    got = ext.read_custom_resource_definition(name)
    assert got.spec.names.short_names == ["dnat"] and got.metadata.uid == stored["metadata"]["uid"]
    assert got.metadata.resource_version == fake.resource_version

    with pytest.raises(ApiException) as err:  # get is all that is served
        ext.list_custom_resource_definition()
    assert err.value.status == 405
    logged = [(r.verb, r.api_group, r.resource, r.namespace, r.name) for r in fake.requests]
    assert logged == [("get", "apiextensions.k8s.io", "customresourcedefinitions", None, name)] * 4 + [
        ("list", "apiextensions.k8s.io", "customresourcedefinitions", None, None)]


# ---------------------------------------------------------------------------------------------
# watch
# ---------------------------------------------------------------------------------------------

def test_watch_streams_create_modify_delete_in_order(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    rv = as_dict(crd.list_cluster_custom_object(G, V, RULES))["metadata"]["resourceVersion"]
    w = watch_rules(crd, resource_version=rv, allow_watch_bookmarks=True)
    fake.wait_for_watches(1, RULES)

    created = fake.create(RULES, rule("web-a"))
    modified = changed(fake, "web-a", internalIp="10.0.1.99")
    fake.create(EIPS, {"metadata": {"name": "other"}})  # another resource: not on this watch
    deleted = fake.delete(RULES, "web-a")

    events = w.wait_events(3)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    rvs = [e["raw_object"]["metadata"]["resourceVersion"] for e in events]
    assert rvs == [created["metadata"]["resourceVersion"], modified["metadata"]["resourceVersion"],
                   deleted["metadata"]["resourceVersion"]]
    assert int(rvs[0]) < int(rvs[1]) < int(rvs[2])
    # DELETED carries the last state with a fresh resourceVersion, like the real API.
    assert events[2]["raw_object"]["spec"]["internalIp"] == "10.0.1.99"
    assert events[2]["raw_object"]["metadata"]["uid"] == created["metadata"]["uid"]
    # For custom objects the client's "model" is plain dict: object and raw_object are equal.
    assert events[0]["object"] == events[0]["raw_object"]
    assert w.watch.resource_version == rvs[2]

    fake.end_watches()
    w.wait_done()
    assert w.error is None


def test_watch_from_resource_version_replays_missed_events(fake: FakeKube,
                                                           crd: client.CustomObjectsApi) -> None:
    fake.create(RULES, rule("web-a"))
    rv = as_dict(crd.list_cluster_custom_object(G, V, RULES))["metadata"]["resourceVersion"]
    # Changes the watcher "missed" while it was not connected:
    fake.create(RULES, rule("web-b"))
    changed(fake, "web-a", externalPort="81")
    fake.delete(RULES, "web-b")

    w = watch_rules(crd, resource_version=rv)
    events = w.wait_events(3)
    assert [(e["type"], e["raw_object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "web-b"), ("MODIFIED", "web-a"), ("DELETED", "web-b")]
    # ...and then live events follow on the same stream.
    fake.create(RULES, rule("web-c"))
    assert w.wait_events(4)[3]["raw_object"]["metadata"]["name"] == "web-c"
    fake.end_watches()
    w.wait_done()


@pytest.mark.parametrize("rv", ["0", None])
def test_watch_without_a_resource_version_is_refused(fake: FakeKube, crd: client.CustomObjectsApi,
                                                     rv: str | None) -> None:
    # The agent always watches from its list's version; the real server's "" and "0" (start with
    # synthetic ADDED events) are not served, and say so before the stream starts.
    kwargs = {"resource_version": rv} if rv is not None else {}
    with pytest.raises(BadRequestException) as err:
        list(stream(crd.list_cluster_custom_object, G, V, RULES, timeout_seconds=WATCH_TIMEOUT, **kwargs))
    assert "FakeKube watches only from a resourceVersion" in status_of(err.value)["message"]
    assert fake.open_watches() == 0


def test_bookmark_on_demand(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    rv = fake.resource_version
    with_bm = watch_rules(crd, resource_version=rv, allow_watch_bookmarks=True)
    without_bm = watch_rules(crd, resource_version=rv)
    fake.wait_for_watches(2, RULES)

    fake.create(RULES, rule("web-a"))
    fake.create(EIPS, {"metadata": {"name": "eip"}})  # advances the global rv past the rule's
    assert fake.bookmark() == 1  # only the watch that asked for bookmarks

    events = with_bm.wait_events(2)
    assert events[1]["type"] == "BOOKMARK"
    assert events[1]["raw_object"] == {"kind": "IptablesDnatRule", "apiVersion": "kubeovn.io/v1",
                                       "metadata": {"resourceVersion": fake.resource_version}}
    # The installed client yields BOOKMARKs and moves its resume point to the bookmark's rv.
    assert isinstance(events[1]["object"], dict)
    assert with_bm.watch.resource_version == fake.resource_version

    assert [e["type"] for e in without_bm.wait_events(1)] == ["ADDED"]
    fake.end_watches()
    with_bm.wait_done()
    without_bm.wait_done()
    assert [e["type"] for e in without_bm.events] == ["ADDED"]


def test_bookmark_interval() -> None:
    with FakeKube(bookmark_interval=0.2) as fk, make_api_client(fk.url) as api:
        w = watch_rules(client.CustomObjectsApi(api), resource_version=fk.resource_version,
                        allow_watch_bookmarks=True)
        events = w.wait_events(2, timeout=3)
        assert [e["type"] for e in events] == ["BOOKMARK", "BOOKMARK"]
        fk.end_watches()
        w.wait_done()


@pytest.mark.parametrize("interval", [None, 0.1])
def test_idle_watch_and_client_read_timeout(interval: float | None) -> None:
    with FakeKube(bookmark_interval=interval) as fk, make_api_client(fk.url) as api:
        crd = client.CustomObjectsApi(api)
        kwargs: dict[str, Any] = {"resource_version": fk.resource_version, "allow_watch_bookmarks": True,
                                  "timeout_seconds": 1, "_request_timeout": (1, 0.4)}
        if interval is None:
            with pytest.raises(urllib3.exceptions.ReadTimeoutError):
                list(stream(crd.list_cluster_custom_object, G, V, RULES, **kwargs))
        else:  # bookmarks keep the connection alive until the server-side timeout
            events = list(stream(crd.list_cluster_custom_object, G, V, RULES, **kwargs))
            assert events and {e["type"] for e in events} == {"BOOKMARK"}


@pytest.mark.parametrize("with_timeout", [True, False])
def test_compacted_resource_version_raises_410(fake: FakeKube, crd: client.CustomObjectsApi,
                                               with_timeout: bool) -> None:
    old_rv = fake.create(RULES, rule("web-a"))["metadata"]["resourceVersion"]
    fake.create(RULES, rule("web-b"))
    fake.compact()
    kwargs: dict[str, Any] = {"timeout_seconds": WATCH_TIMEOUT} if with_timeout else {}
    fake.clear_requests()

    with pytest.raises(ApiException) as err:
        for _ in stream(crd.list_cluster_custom_object, G, V, RULES,
                        resource_version=old_rv, **kwargs):
            pass
    assert type(err.value) is ApiException  # the base class, not a status-specific subclass
    assert err.value.status == 410
    assert err.value.reason == f"Expired: too old resource version: {old_rv} ({fake.resource_version})"
    assert err.value.body is None
    # Without timeout_seconds the client retries once from the same rv before raising.
    watches = [r for r in fake.requests if r.verb == "watch"]
    assert len(watches) == (1 if with_timeout else 2)
    assert all(r.query["resourceVersion"] == old_rv for r in watches)

    # Recovery path: relist, then watch from the list's rv.
    rv = as_dict(crd.list_cluster_custom_object(G, V, RULES))["metadata"]["resourceVersion"]
    w = watch_rules(crd, resource_version=rv)
    fake.create(RULES, rule("web-c"))
    assert w.wait_events(1)[0]["raw_object"]["metadata"]["name"] == "web-c"
    fake.end_watches()
    w.wait_done()


def test_server_side_timeout_ends_stream_cleanly(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    start = time.monotonic()
    events = list(stream(crd.list_cluster_custom_object, G, V, RULES,
                         resource_version=fake.resource_version, timeout_seconds=1))
    elapsed = time.monotonic() - start
    assert events == []
    assert 0.9 <= elapsed < 3, elapsed
    assert fake.open_watches() == 0


def test_clean_end_without_timeout_makes_client_rewatch(fake: FakeKube,
                                                        crd: client.CustomObjectsApi) -> None:
    # Without timeout_seconds, Watch.stream treats a cleanly ended stream as "reconnect from the
    # last resourceVersion" and the caller never notices.
    w = WatchThread(crd.list_cluster_custom_object, G, V, RULES, resource_version=fake.resource_version)
    fake.wait_for_watches(1, RULES)
    seen_rv = fake.create(RULES, rule("web-a"))["metadata"]["resourceVersion"]
    w.wait_events(1)
    fake.clear_requests()
    assert fake.end_watches() == 1
    wait_until(lambda: any(r.verb == "watch" for r in fake.requests), what="re-watch")
    rewatch = next(r for r in fake.requests if r.verb == "watch")
    assert rewatch.query["resourceVersion"] == seen_rv
    fake.wait_for_watches(1, RULES)
    fake.create(RULES, rule("web-b"))
    assert w.wait_events(2)[1]["raw_object"]["metadata"]["name"] == "web-b"
    assert not w.done.is_set()
    fake.break_watches()  # the only way this stream ends (besides Watch.stop())
    w.wait_done()
    assert isinstance(w.error, urllib3.exceptions.ProtocolError)


@pytest.mark.parametrize("with_timeout", [True, False])
def test_break_watches_raises_protocol_error(fake: FakeKube, crd: client.CustomObjectsApi,
                                             with_timeout: bool) -> None:
    kwargs: dict[str, Any] = {"timeout_seconds": WATCH_TIMEOUT} if with_timeout else {}
    w = WatchThread(crd.list_cluster_custom_object, G, V, RULES,
                    resource_version=fake.resource_version, **kwargs)
    fake.wait_for_watches(1, RULES)
    fake.create(RULES, rule("web-a"))
    assert fake.break_watches() == 1
    w.wait_done()
    # Events queued before the break are still delivered, then the generator raises.
    assert [e["type"] for e in w.events] == ["ADDED"]
    assert type(w.error) is urllib3.exceptions.ProtocolError
    assert "Response ended prematurely" in str(w.error)
    assert len([r for r in fake.requests if r.verb == "watch"]) == 1  # no automatic retry


def test_send_raw_unknown_type_and_error_events(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    w = watch_rules(crd, resource_version=fake.resource_version)
    fake.wait_for_watches(1, RULES)
    assert fake.send_raw(RULES, {"type": "WEIRD", "object": {}}) == 1
    event = w.wait_events(1)[0]
    assert event == {"type": "WEIRD", "object": {}, "raw_object": {}}
    fake.send_raw(RULES, {"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "boom", "reason": "InternalError", "code": 500}})
    w.wait_done()
    assert isinstance(w.error, ApiException)
    assert w.error.status == 500 and w.error.reason == "InternalError: boom"


# ---------------------------------------------------------------------------------------------
# failures
# ---------------------------------------------------------------------------------------------

def test_set_down_refuses_connections_then_recovers(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    fake.create(RULES, rule("web-a"))
    assert len(as_dict(crd.list_cluster_custom_object(G, V, RULES))["items"]) == 1  # pooled keep-alive conn
    w = watch_rules(crd, resource_version=fake.resource_version)
    fake.wait_for_watches(1, RULES)

    fake.set_down(True)
    w.wait_done()
    assert isinstance(w.error, urllib3.exceptions.ProtocolError)  # open watch cut
    start = time.monotonic()
    with pytest.raises(urllib3.exceptions.MaxRetryError) as err:
        as_dict(crd.list_cluster_custom_object(G, V, RULES))
    assert isinstance(err.value.reason, urllib3.exceptions.NewConnectionError)
    assert "Connection refused" in str(err.value.reason)
    assert time.monotonic() - start < 2  # refused, not hanging
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", int(fake.url.rsplit(":", 1)[1]))) != 0

    fake.set_down(False)
    assert len(as_dict(crd.list_cluster_custom_object(G, V, RULES))["items"]) == 1  # same URL works again


def test_fail_next(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    fake.fail_next(2, status=500)
    fake.fail_next(1, status=503, verb="watch")
    for _ in range(2):
        with pytest.raises(ServiceException) as err:
            as_dict(crd.list_cluster_custom_object(G, V, RULES))
        assert err.value.status == 500
        assert status_of(err.value)["reason"] == "InternalError"
    with pytest.raises(ServiceException) as err:
        list(stream(crd.list_cluster_custom_object, G, V, RULES, timeout_seconds=1))
    assert err.value.status == 503
    assert as_dict(crd.list_cluster_custom_object(G, V, RULES))["items"] == []


def test_unknown_paths_are_404_status(fake: FakeKube, api_client: client.ApiClient) -> None:
    with pytest.raises(NotFoundException) as err:
        client.CustomObjectsApi(api_client).list_cluster_custom_object("example.com", "v1", "widgets")
    body = status_of(err.value)
    assert (body["kind"], body["code"], body["reason"]) == ("Status", 404, "NotFound")
    with pytest.raises(NotFoundException):
        client.CoreV1Api(api_client).list_namespaced_pod("default")
    with pytest.raises(NotFoundException):  # cluster-scoped resources have no namespaced path
        client.CustomObjectsApi(api_client).list_namespaced_custom_object(G, V, "default", RULES)
    with pytest.raises(NotFoundException):  # no subresources are served
        client.CustomObjectsApi(api_client).patch_cluster_custom_object_status(G, V, EIPS, "eip", {})
    off_the_api = api_client.call_api("GET", f"{fake.url}/version")  # nor paths off the API
    assert off_the_api.status == 404 and json.loads(off_the_api.read())["reason"] == "NotFound"
    assert [(r.verb, r.resource, r.path) for r in fake.requests][-1] == ("get", None, "/version")


def test_verbs_the_agent_does_not_use_are_405(fake: FakeKube, api_client: client.ApiClient) -> None:
    fake.create(RULES, rule("web-a"))
    crd = client.CustomObjectsApi(api_client)
    for attempt in (lambda: crd.get_cluster_custom_object(G, V, RULES, "web-a"),
                    lambda: crd.replace_cluster_custom_object(G, V, RULES, "web-a", rule("web-a")),
                    lambda: crd.patch_cluster_custom_object(G, V, RULES, "web-a", {"spec": {}}),
                    lambda: crd.delete_cluster_custom_object(G, V, RULES, "web-a"),
                    lambda: crd.create_cluster_custom_object(G, V, RULES, rule("web-b")),
                    lambda: client.CoreV1Api(api_client).list_namespaced_event("kube-system")):
        with pytest.raises(ApiException) as err:
            attempt()
        body = status_of(err.value)
        assert (err.value.status, body["reason"]) == (405, "MethodNotAllowed")
        assert body["message"].startswith("FakeKube does not serve ")
    assert [o["metadata"]["name"] for o in fake.objects(RULES)] == ["web-a"]  # nothing changed


def test_stop_ends_watches_and_closes_socket() -> None:
    fk = FakeKube().start()
    with make_api_client(fk.url) as api:
        w = watch_rules(client.CustomObjectsApi(api), resource_version=fk.resource_version)
        fk.wait_for_watches(1)
        start = time.monotonic()
        fk.stop()
        w.wait_done(timeout=2)
        assert time.monotonic() - start < 2
        assert isinstance(w.error, urllib3.exceptions.ProtocolError)
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", int(fk.url.rsplit(":", 1)[1]))) != 0


def test_caller_provided_socket() -> None:
    # The caller may bind inside another network namespace; an explicit port keeps set_down usable.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    with FakeKube(sock) as fk, make_api_client(fk.url) as api:
        assert fk.url == f"http://127.0.0.1:{port}"
        crd = client.CustomObjectsApi(api)
        assert as_dict(crd.list_cluster_custom_object(G, V, EIPS))["items"] == []
        fk.set_down(True)
        with pytest.raises(urllib3.exceptions.MaxRetryError):
            as_dict(crd.list_cluster_custom_object(G, V, EIPS))
        fk.set_down(False)
        assert as_dict(crd.list_cluster_custom_object(G, V, EIPS))["items"] == []
    assert sock.fileno() == -1  # closed by stop()


# ---------------------------------------------------------------------------------------------
# events (core v1) and the request log
# ---------------------------------------------------------------------------------------------

def test_events_create(fake: FakeKube, api_client: client.ApiClient) -> None:
    core = client.CoreV1Api(api_client)
    now = datetime.now(timezone.utc)
    body = client.CoreV1Event(
        metadata=client.V1ObjectMeta(name="web-a.17a2b3c4d5e6f708", namespace="default"),
        involved_object=client.V1ObjectReference(api_version="kubeovn.io/v1", kind="IptablesDnatRule",
                                                 name="web-a", uid="1234"),
        reason="BackendsChanged", message="3 backends", type="Normal", count=1,
        first_timestamp=now, last_timestamp=now,
        source=client.V1EventSource(component="natgw-agent", host="gw1"))
    created = core.create_namespaced_event("default", body)
    assert isinstance(created, client.CoreV1Event) and created.metadata is not None
    assert created.metadata.resource_version == fake.resource_version and created.metadata.uid
    name = created.metadata.name
    assert name == "web-a.17a2b3c4d5e6f708"
    assert created.involved_object.name == "web-a"

    stored = fake.objects("events", "default")
    assert len(stored) == 1 and stored[0]["kind"] == "Event" and stored[0]["apiVersion"] == "v1"
    assert stored[0]["involvedObject"]["kind"] == "IptablesDnatRule"
    assert stored[0]["source"] == {"component": "natgw-agent", "host": "gw1"}
    assert fake.get("events", name, "default")["metadata"]["uid"] == created.metadata.uid
    assert fake.objects("events", "kube-system") == []

    with pytest.raises(BadRequestException):  # namespace in body must match the path
        core.create_namespaced_event("other", body)
    with pytest.raises(ApiException) as err:  # names are unique
        core.create_namespaced_event("default", body)
    assert err.value.status == 409 and status_of(err.value)["reason"] == "AlreadyExists"
    assert len(fake.objects("events")) == 1


def test_request_log_records_rbac_attributes(fake: FakeKube, api_client: client.ApiClient) -> None:
    crd = client.CustomObjectsApi(api_client)
    as_dict(crd.list_cluster_custom_object(G, V, RULES, limit=1))
    list(stream(crd.list_cluster_custom_object, G, V, EIPS,
                resource_version=fake.resource_version, timeout_seconds=1))
    client.CoreV1Api(api_client).create_namespaced_event(
        "kube-system", {"metadata": {"name": "web-a.1"}, "involvedObject": {"name": "web-a"}})
    with pytest.raises(ApiException):
        crd.delete_cluster_custom_object(G, V, RULES, "web-a")
    with pytest.raises(ApiException):
        crd.patch_cluster_custom_object_status(G, V, EIPS, "eip", {"status": {}})

    reqs = fake.requests
    assert [(r.verb, r.api_group, r.resource, r.namespace, r.name) for r in reqs] == [
        ("list", G, RULES, None, None), ("watch", G, EIPS, None, None),
        ("create", "", "events", "kube-system", None), ("delete", G, RULES, None, "web-a"),
        ("patch", G, f"{EIPS}/status", None, "eip")]  # a subresource as RBAC rules spell it
    assert reqs[0].path == f"/apis/{G}/{V}/{RULES}" and reqs[0].query["limit"] == "1"
    assert reqs[1].query["watch"] == "true" and reqs[1].query["timeoutSeconds"] == "1"
    assert reqs[2].path == "/api/v1/namespaces/kube-system/events"
    fake.clear_requests()
    assert fake.requests == []
