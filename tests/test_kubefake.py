"""The fake apiserver (tests/kubefake.py) driven by the real ``kubernetes`` client.

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
  Status JSON in ``.body``.
"""
from __future__ import annotations

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

from tests.kubefake import (FakeKube, LabelRequirement, SelectorError, labels_match,
                            parse_label_selector)

G, V = "kubeovn.io", "v1"
RULES, EIPS = "iptables-dnat-rules", "iptables-eips"
WATCH_TIMEOUT = 5  # server-side timeoutSeconds: bounds every watch even if a test goes wrong


def rule(name: str, labels: dict[str, str] | None = None, port: str = "80") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "kubeovn.io/v1", "kind": "IptablesDnatRule", "metadata": meta,
            "spec": {"eip": "eip-web", "externalPort": port, "protocol": "tcp",
                     "internalIp": "10.0.1.11", "internalPort": "8080"}}


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
# list / get
# ---------------------------------------------------------------------------------------------

def test_list_and_get_carry_resource_versions(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
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
    assert listed["items"][0]["metadata"]["creationTimestamp"].endswith("Z")

    got = as_dict(crd.get_cluster_custom_object(G, V, RULES, "web-b"))
    assert got["metadata"]["resourceVersion"] == b["metadata"]["resourceVersion"]
    eips = as_dict(crd.list_cluster_custom_object(G, V, EIPS))
    assert eips["kind"] == "IptablesEIPList" and eips["items"][0]["kind"] == "IptablesEIP"

    with pytest.raises(NotFoundException) as err:
        as_dict(crd.get_cluster_custom_object(G, V, RULES, "nope"))
    assert err.value.status == 404
    assert status_of(err.value)["reason"] == "NotFound"


# ---------------------------------------------------------------------------------------------
# watch
# ---------------------------------------------------------------------------------------------

def test_watch_streams_create_modify_delete_in_order(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    rv = as_dict(crd.list_cluster_custom_object(G, V, RULES))["metadata"]["resourceVersion"]
    w = watch_rules(crd, resource_version=rv, allow_watch_bookmarks=True)
    fake.wait_for_watches(1, RULES)

    created = fake.create(RULES, rule("web-a"))
    modified = fake.patch(RULES, "web-a", {"spec": {"internalIp": "10.0.1.99"}})
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
    assert modified["metadata"]["generation"] == 2
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
    fake.patch(RULES, "web-a", {"metadata": {"labels": {"x": "y"}}})
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
def test_watch_without_resource_version_starts_with_synthetic_added(
        fake: FakeKube, crd: client.CustomObjectsApi, rv: str | None) -> None:
    fake.create(RULES, rule("web-b"))
    fake.create(RULES, rule("web-a"))
    fake.compact()  # synthetic ADDED comes from the current state, not from history
    kwargs = {"resource_version": rv} if rv is not None else {}
    w = watch_rules(crd, **kwargs)
    events = w.wait_events(2)
    assert [(e["type"], e["raw_object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "web-a"), ("ADDED", "web-b")]
    fake.wait_for_watches(1, RULES)
    fake.create(RULES, rule("web-c"))
    assert w.wait_events(3)[2]["type"] == "ADDED"
    fake.end_watches()
    w.wait_done()


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


def test_history_limit_expires_old_resource_versions() -> None:
    with FakeKube(history_limit=2) as fk, make_api_client(fk.url) as api:
        crd = client.CustomObjectsApi(api)
        first = fk.create(RULES, rule("a"))["metadata"]["resourceVersion"]
        for name in ("b", "c", "d"):
            fk.create(RULES, rule(name))
        with pytest.raises(ApiException) as err:
            list(stream(crd.list_cluster_custom_object, G, V, RULES,
                        resource_version=first, timeout_seconds=WATCH_TIMEOUT))
        assert err.value.status == 410


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


def test_label_selector_on_watch(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    w = watch_rules(crd, resource_version=fake.resource_version, label_selector="app=web")
    fake.wait_for_watches(1, RULES)
    fake.create(RULES, rule("db", {"app": "db"}))                 # not selected: nothing
    fake.create(RULES, rule("web", {"app": "web"}))               # ADDED
    fake.patch(RULES, "db", {"metadata": {"labels": {"app": "web"}}})   # enters selector: ADDED
    fake.patch(RULES, "web", {"metadata": {"labels": {"app": "x"}}})    # leaves selector: DELETED
    fake.patch(RULES, "db", {"spec": {"externalPort": "81"}})      # stays selected: MODIFIED
    fake.delete(RULES, "web")                                     # not selected any more: nothing
    fake.delete(RULES, "db")                                      # DELETED
    events = w.wait_events(5)
    assert [(e["type"], e["raw_object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "web"), ("ADDED", "db"), ("DELETED", "web"), ("MODIFIED", "db"), ("DELETED", "db")]
    fake.end_watches()
    w.wait_done()
    assert len(w.events) == 5
    assert fake.requests[-1].query["labelSelector"] == "app=web"


# ---------------------------------------------------------------------------------------------
# selectors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("selector", "names"), [
    ("app=web", ["a", "b"]),
    ("app==web", ["a", "b"]),
    ("app!=web", ["c", "d"]),             # includes d, which has no app label
    ("app", ["a", "b", "c"]),
    ("!app", ["d"]),
    ("app in (web,db)", ["a", "b", "c"]),
    ("app notin (web)", ["c", "d"]),
    ("app=web,tier!=front", ["b"]),
    ("app in (web), !tier", []),
    ("kubeovn.io/gw=gw1", ["a", "c"]),
    ("", ["a", "b", "c", "d"]),
])
def test_label_selector_on_list(fake: FakeKube, crd: client.CustomObjectsApi,
                                selector: str, names: list[str]) -> None:
    fake.create(RULES, rule("a", {"app": "web", "tier": "front", "kubeovn.io/gw": "gw1"}))
    fake.create(RULES, rule("b", {"app": "web", "tier": "back"}))
    fake.create(RULES, rule("c", {"app": "db", "tier": "back", "kubeovn.io/gw": "gw1"}))
    fake.create(RULES, rule("d", {"other": "x"}))
    items = as_dict(crd.list_cluster_custom_object(G, V, RULES, label_selector=selector))["items"]
    assert [i["metadata"]["name"] for i in items] == names


def test_bad_selectors_are_400(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    cases: list[dict[str, Any]] = [{"label_selector": "app in web"}, {"label_selector": "a=b=c"},
                                   {"field_selector": "spec.eip=x"}]
    for kwargs in cases:
        with pytest.raises(BadRequestException) as err:
            as_dict(crd.list_cluster_custom_object(G, V, RULES, **kwargs))
        body = status_of(err.value)
        assert body["kind"] == "Status" and body["code"] == 400 and body["reason"] == "BadRequest"
    with pytest.raises(BadRequestException):  # also on watch, before the stream starts
        list(stream(crd.list_cluster_custom_object, G, V, RULES,
                    label_selector="!", timeout_seconds=WATCH_TIMEOUT))


def test_field_selector_on_list(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    fake.create(RULES, rule("a"))
    fake.create(RULES, rule("b"))
    names = [i["metadata"]["name"] for i in
             as_dict(crd.list_cluster_custom_object(G, V, RULES, field_selector="metadata.name=b"))["items"]]
    assert names == ["b"]
    names = [i["metadata"]["name"] for i in
             as_dict(crd.list_cluster_custom_object(G, V, RULES, field_selector="metadata.name!=b"))["items"]]
    assert names == ["a"]


def test_selector_parser_directly() -> None:
    assert parse_label_selector("a in (x, y),!b, c!=d") == (
        LabelRequirement("a", "in", ("x", "y")), LabelRequirement("b", "!"),
        LabelRequirement("c", "!=", ("d",)))
    assert parse_label_selector("a=") == (LabelRequirement("a", "=", ("",)),)
    assert labels_match(parse_label_selector("n>3"), {"metadata": {"labels": {"n": "4"}}})
    assert not labels_match(parse_label_selector("n<3"), {"metadata": {"labels": {"n": "x"}}})
    for bad in ("a in ()", "a,,b", "=a", "a in (x", "a b", "-bad", "a=b c", "a>b"):
        with pytest.raises(SelectorError):
            parse_label_selector(bad)


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

def test_events_create_list_patch(fake: FakeKube, api_client: client.ApiClient) -> None:
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
    assert created.metadata.resource_version and created.metadata.uid
    name = created.metadata.name
    assert name == "web-a.17a2b3c4d5e6f708"
    assert created.involved_object.name == "web-a"

    stored = fake.objects("events", "default")
    assert len(stored) == 1 and stored[0]["kind"] == "Event" and stored[0]["apiVersion"] == "v1"
    assert stored[0]["involvedObject"]["kind"] == "IptablesDnatRule"
    assert stored[0]["source"] == {"component": "natgw-agent", "host": "gw1"}

    listed = core.list_namespaced_event("default", field_selector="involvedObject.name=web-a")
    assert isinstance(listed, client.CoreV1EventList)
    assert [e.reason for e in listed.items] == ["BackendsChanged"]
    assert listed.metadata is not None and listed.metadata.resource_version == fake.resource_version
    assert core.list_namespaced_event("kube-system").items == []

    # Deduplicating recorders bump count with a patch (the client sends strategic merge here).
    patched = core.patch_namespaced_event(name, "default", {"count": 2})
    assert patched.count == 2 and patched.reason == "BackendsChanged"
    assert fake.get("events", name, "default")["count"] == 2

    with pytest.raises(BadRequestException):  # namespace in body must match the path
        core.create_namespaced_event("other", body)

    logged = [(r.verb, r.resource, r.namespace, r.api_group, r.name) for r in fake.requests]
    assert logged[:4] == [("create", "events", "default", "", None),
                          ("list", "events", "default", "", None),
                          ("list", "events", "kube-system", "", None),
                          ("patch", "events", "default", "", name)]
    assert fake.requests[0].body["involvedObject"]["name"] == "web-a"


def test_request_log_records_rbac_verbs(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    crd.create_cluster_custom_object(G, V, RULES, rule("web-a"))
    obj = as_dict(crd.get_cluster_custom_object(G, V, RULES, "web-a"))
    obj["spec"]["externalPort"] = "81"
    crd.replace_cluster_custom_object(G, V, RULES, "web-a", obj)
    crd.patch_cluster_custom_object(G, V, RULES, "web-a", {"metadata": {"labels": {"a": "b"}}})
    as_dict(crd.list_cluster_custom_object(G, V, RULES))
    list(stream(crd.list_cluster_custom_object, G, V, RULES,
                resource_version=fake.resource_version, timeout_seconds=1))
    crd.delete_cluster_custom_object(G, V, RULES, "web-a")

    reqs = fake.requests
    assert [(r.verb, r.name) for r in reqs] == [
        ("create", None), ("get", "web-a"), ("update", "web-a"), ("patch", "web-a"),
        ("list", None), ("watch", None), ("delete", "web-a")]
    assert all(r.resource == RULES and r.api_group == G and r.namespace is None
               and r.subresource is None for r in reqs)
    assert [r.watch for r in reqs] == [False] * 5 + [True, False]
    assert [r.method for r in reqs] == ["POST", "GET", "PUT", "PATCH", "GET", "GET", "DELETE"]
    assert reqs[5].query["watch"] == "true" and reqs[5].query["timeoutSeconds"] == "1"
    assert reqs[0].body["metadata"]["name"] == "web-a"
    assert reqs[3].body == {"metadata": {"labels": {"a": "b"}}}


def test_status_subresource_and_conflicts(fake: FakeKube, crd: client.CustomObjectsApi) -> None:
    fake.create(RULES, {**rule("web-a"), "status": {"ready": True}})
    obj = as_dict(crd.get_cluster_custom_object(G, V, RULES, "web-a"))
    # The main resource keeps the stored status; /status changes only status.
    crd.replace_cluster_custom_object(G, V, RULES, "web-a", {**obj, "status": {"ready": False}})
    assert fake.get(RULES, "web-a")["status"] == {"ready": True}
    crd.patch_cluster_custom_object_status(G, V, RULES, "web-a",
                                           {"status": {"ready": False}, "spec": {"eip": "ignored"}})
    stored = fake.get(RULES, "web-a")
    assert stored["status"] == {"ready": False} and stored["spec"]["eip"] == "eip-web"
    assert [(r.verb, r.subresource) for r in fake.requests][-1] == ("patch", "status")
    # A stale resourceVersion on update is a 409 Conflict, as with optimistic concurrency.
    with pytest.raises(ApiException) as err:
        crd.replace_cluster_custom_object(G, V, RULES, "web-a", obj)
    assert err.value.status == 409 and status_of(err.value)["reason"] == "Conflict"
    with pytest.raises(ApiException) as err:
        crd.create_cluster_custom_object(G, V, RULES, rule("web-a"))
    assert err.value.status == 409 and status_of(err.value)["reason"] == "AlreadyExists"
