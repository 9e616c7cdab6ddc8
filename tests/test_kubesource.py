"""The Kubernetes source through the real client against the fake API server: sync, every
watch failure, Events, ownership, and the RBAC the agent needs (no root, no kernel)."""
from __future__ import annotations

import copy
import time
from typing import Any, Callable, Iterator

import pytest
import yaml
from kubernetes.client import ApiClient, Configuration

from agent.sources.events import EventRecorder
from agent.sources.kube import EIPS, RULES, KubeSource, WatchSettings
from agent.core.model import Backend, Identity
from agent.ops.report import Reporter
from tests.oracles import evaluate
from agent.settings import Settings
from tests.builders import ROOT, eip, rule
from tests.kubefake import FakeKube, Request
from tests.kubefake.crds import BASE_FIELDS, CRD_NAME, SHARE_FIELDS, dnat_rule_crd as crd_with

SETTINGS = Settings(gateway="gw1")
FAST = WatchSettings(server_timeout=2, connect_timeout=1, inactivity_timeout=3, backoff_min=0.05, backoff_max=0.3)
WEB = Identity("172.18.0.10", 80, "tcp")
SEEN: list[Request] = []  # every request the agent made in this module, for the RBAC check


def api_client(fake: FakeKube) -> ApiClient:
    cfg = Configuration()
    cfg.host = fake.url
    cfg.proxy = None  # the client would otherwise pick up http_proxy from the environment
    return ApiClient(cfg)


def wait(check: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def services(source: KubeSource) -> dict[Identity, Any]:
    return evaluate(source.objects(), SETTINGS, Reporter())[0].services


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    # Bookmarks every 0.5 s keep idle watches under the agent's inactivity timeout.
    with FakeKube(bookmark_interval=0.5) as server:
        yield server
        SEEN.extend(server.requests)


@pytest.fixture
def world(fake: FakeKube) -> FakeKube:
    fake.create(EIPS, eip("eip-web", "172.18.0.10"))
    fake.create(RULES, rule("web-a", 80, "10.0.1.11"))
    fake.create(RULES, rule("web-b", 80, "10.0.1.12"))
    return fake


@pytest.fixture
def source(fake: FakeKube) -> Iterator[KubeSource]:
    src = KubeSource(api_client(fake), FAST)
    src.start()
    yield src
    src.stop()


def test_initial_sync_lists_then_watches_from_the_lists_version(world: FakeKube, source: KubeSource) -> None:
    wait(lambda: source.ready, what="both initial lists")
    assert source.poll() is True
    assert source.take_changes() is None  # the first sync evaluates everything
    assert services(source)[WEB].backends == (Backend("10.0.1.11", 8080), Backend("10.0.1.12", 8080))
    world.wait_for_watches(2)
    lists = {r.resource: r for r in world.requests if r.verb == "list"}
    watches = {r.resource: r for r in world.requests if r.verb == "watch"}
    assert set(lists) == set(watches) == {RULES, EIPS}
    for plural, w in watches.items():
        assert w.query["resourceVersion"] == world.resource_version  # the list's version: nothing missed
        assert w.query["allowWatchBookmarks"] == "true"
        assert 2 <= int(w.query["timeoutSeconds"]) <= 4  # server-side timeout, randomised


def test_nothing_is_ready_before_both_lists_complete(fake: FakeKube) -> None:
    fake.create(EIPS, eip("eip-web", "172.18.0.10"))
    fake.fail_next(4, status=500)  # the first lists fail
    src = KubeSource(api_client(fake), FAST)
    src.start()
    try:
        assert not src.ready
        wait(lambda: src.ready, what="lists after failures")
        assert len([r for r in fake.requests if r.verb == "list"]) >= 6
    finally:
        src.stop()


def test_add_modify_delete_flow_through(world: FakeKube, source: KubeSource) -> None:
    wait(lambda: source.ready and source.poll(), what="initial sync")
    world.wait_for_watches(2)
    world.create(RULES, rule("web-c", 80, "10.0.1.13"))
    wait(source.poll, what="added rule")
    assert len(services(source)[WEB].backends) == 3
    changed = copy.deepcopy(world.get(RULES, "web-c"))
    changed["spec"]["internalPort"] = "9090"
    world.update(RULES, changed)
    wait(lambda: Backend("10.0.1.13", 9090) in services(source)[WEB].backends, what="modified rule")
    world.delete(RULES, "web-c")
    wait(lambda: len(services(source)[WEB].backends) == 2, what="deleted rule")
    assert source.relists == 0


def test_deletion_during_a_broken_watch_then_410_relists_and_removes_it(world: FakeKube, source: KubeSource) -> None:
    wait(lambda: source.ready and source.poll(), what="initial sync")
    world.wait_for_watches(2)
    world.set_down(True)  # the stream breaks ...
    world.delete(RULES, "web-b")  # ... the rule goes while nobody watches ...
    world.compact()  # ... and the version the agent would resume from is compacted away
    time.sleep(0.2)
    assert Backend("10.0.1.12", 8080) in services(source)[WEB].backends  # the down API removes nothing
    world.set_down(False)
    wait(lambda: services(source)[WEB].backends == (Backend("10.0.1.11", 8080),), what="relist to drop web-b")
    assert source.relists >= 1
    # After a relist the changes are unknown: everything is evaluated once, then deltas again.
    assert source.take_changes() is None and source.take_changes() == set()


def test_server_restart_mid_stream_resumes_from_the_last_version(world: FakeKube, source: KubeSource) -> None:
    wait(lambda: source.ready and source.poll(), what="initial sync")
    world.wait_for_watches(2)
    world.create(RULES, rule("web-c", 80, "10.0.1.13"))
    wait(source.poll, what="web-c")
    seen = world.resource_version
    world.clear_requests()
    world.break_watches()
    resumed = wait(lambda: [r for r in world.requests if r.verb == "watch" and r.resource == RULES],
                   what="the watch to resume")
    assert int(resumed[0].query["resourceVersion"]) >= int(seen)
    assert not [r for r in world.requests if r.verb == "list"]  # resumed, not relisted
    world.create(RULES, rule("web-d", 80, "10.0.1.14"))
    wait(lambda: len(services(source)[WEB].backends) == 4, what="events after the resume")
    assert source.restarts >= 2 and source.relists == 0


def test_api_down_keeps_the_last_state_then_converges(world: FakeKube, source: KubeSource) -> None:
    wait(lambda: source.ready and source.poll(), what="initial sync")
    world.wait_for_watches(2)
    world.set_down(True)
    world.create(RULES, rule("web-c", 80, "10.0.1.13"))
    time.sleep(1.0)  # several reconnects fail meanwhile
    assert source.poll() is False and len(services(source)[WEB].backends) == 2
    world.set_down(False)
    wait(lambda: len(services(source)[WEB].backends) == 3, what="convergence after the API returns")


def test_unknown_event_types_are_skipped(world: FakeKube, source: KubeSource) -> None:
    wait(lambda: source.ready and source.poll(), what="initial sync")
    world.wait_for_watches(2)
    world.send_raw(RULES, {"type": "WEIRD", "object": {"metadata": {"name": "x"}}})
    world.create(RULES, rule("web-c", 80, "10.0.1.13"))
    wait(lambda: len(services(source)[WEB].backends) == 3, what="the event after the unknown one")
    assert source.relists == 0


def test_bookmark_moves_the_resume_point(world: FakeKube, source: KubeSource) -> None:
    wait(lambda: source.ready and source.poll(), what="initial sync")
    world.wait_for_watches(2)
    world.create(EIPS, eip("eip-unrelated", "172.18.0.99", gateway="gw9"))  # bumps the global version
    world.bookmark(RULES)
    time.sleep(0.2)
    world.clear_requests()
    world.break_watches(RULES)
    (resumed,) = wait(lambda: [r for r in world.requests if r.verb == "watch" and r.resource == RULES],
                      what="the watch to resume")
    assert int(resumed.query["resourceVersion"]) >= int(world.get(EIPS, "eip-unrelated")["metadata"]["resourceVersion"])


def test_other_gateways_rules_are_ignored_and_a_rule_moves_in_when_its_eip_appears(
        fake: FakeKube, source: KubeSource) -> None:
    fake.create(EIPS, eip("eip-other", "172.18.0.11", gateway="gw2"))
    fake.create(RULES, rule("other-a", 80, "10.0.1.11", eip_name="eip-other"))
    fake.create(RULES, rule("late-a", 443, "10.0.1.11", eip_name="eip-late"))
    wait(lambda: source.ready, what="initial sync")
    fake.wait_for_watches(2)
    assert services(source) == {}
    fake.create(EIPS, eip("eip-late", "172.18.0.12"))
    wait(lambda: list(services(source)) == [Identity("172.18.0.12", 443, "tcp")], what="the late EIP's rule")


def test_invalid_rule_gets_one_warning_event_per_change(world: FakeKube, source: KubeSource) -> None:
    world.create(RULES, rule("web-bad", 80, "10.0.1.300"))
    # In the source (by the list or, if that came first, by the watch) before evaluating.
    wait(lambda: source.ready and "web-bad" in str(source.objects()), what="the bad rule in the source")
    events = EventRecorder(api_client(world), "kube-system", host="gw1")
    events.start()
    reporter = Reporter(events, "gw1")
    try:
        for _ in range(3):  # three syncs of the same state: one Event
            evaluate(source.objects(), SETTINGS, reporter)
        wait(lambda: events.sent == 1, what="the Event")
        bad = copy.deepcopy(world.get(RULES, "web-bad"))
        bad["spec"]["internalIp"] = "10.0.1.301"
        world.update(RULES, bad)
        wait(lambda: "10.0.1.301" in str(source.objects()), what="the change")
        evaluate(source.objects(), SETTINGS, reporter)
        evaluate(source.objects(), SETTINGS, reporter)
        wait(lambda: events.sent == 2, what="a second Event for the new version")
        time.sleep(0.2)
        assert events.sent == 2
    finally:
        events.stop()
    recorded = world.objects("events", namespace="kube-system")
    assert [e["involvedObject"]["name"] for e in recorded] == ["web-bad", "web-bad"]
    first = recorded[0]
    assert first["type"] == "Warning" and first["reason"] == "InvalidRule"
    assert first["involvedObject"]["uid"] == world.get(RULES, "web-bad")["metadata"]["uid"]
    assert first["involvedObject"]["kind"] == "IptablesDnatRule"
    assert "spec.internalIp" in first["message"] and "10.0.1.300" in first["message"]
    assert "10.0.1.301" in recorded[1]["message"]


# ---- the CRD check: a cluster that cannot work is refused loudly

def crd_check(fake: FakeKube, health: Any, events: Any = None, **kwargs: Any) -> Any:
    """The agent's CRD check (agent/run/crdcheck.py), reading through the client as `run` does."""
    from agent.backoff import Backoff
    from agent.run.crdcheck import CrdCheck, reader

    return CrdCheck(reader(api_client(fake)), health, events, "gw1", **{"backoff": Backoff(0.05, 0.2, jitter=0), **kwargs})


@pytest.mark.parametrize("fields, missing", [
    (BASE_FIELDS, ["type", "sessionAffinity", "sessionAffinityTimeoutSeconds"]),
    ([*BASE_FIELDS, "type"], ["sessionAffinity", "sessionAffinityTimeoutSeconds"]),
    (SHARE_FIELDS, []),
])
def test_the_crd_schema_decides_readiness_and_is_said_in_events(fake: FakeKube, fields: list[str],
                                                               missing: list[str]) -> None:
    from agent.ops.health import Health

    fake.set_crd(crd_with(fields))
    health = Health(60, 30)
    health.synced()
    events = EventRecorder(api_client(fake), "kube-system", host="gw1")
    events.start()
    try:
        check = crd_check(fake, health, events)
        for _ in range(3):  # read again and again (the periodic check): the same verdict, said once
            check.check_once()
        assert [p.split("spec.")[1].split(":")[0] for p in health.problems] == missing
        assert all("kube-ovn" in p for p in health.problems)  # and which kube-ovn it takes
        assert health.readyz()[0] is (not missing)
        wait(lambda: events.sent == len(missing), what="one Event per missing field")
        time.sleep(0.1)
        assert events.sent == len(missing)
    finally:
        events.stop()
    recorded = fake.objects("events", namespace="kube-system")
    assert [(e["reason"], e["involvedObject"]["kind"]) for e in recorded] == [("UnsupportedCRD", "VpcNatGateway")] * len(missing)


def test_an_unreadable_crd_keeps_the_agent_not_ready_until_one_read_succeeds(fake: FakeKube) -> None:
    import structlog

    from agent.ops.health import Health

    health = Health(60, 30)
    health.synced()
    fake.fail_next(2, status=503, verb="get")  # right after start: the API is not quite there
    with structlog.testing.capture_logs() as logs:
        check = crd_check(fake, health)
        assert health.problems == ["CRD not checked yet (reading iptables-dnat-rules.kubeovn.io)"]  # before any answer
        delays = [check.check_once() for _ in range(2)]
        assert health.problems == ["CRD not checked yet (iptables-dnat-rules.kubeovn.io: HTTP 503 Service Unavailable)"]
        assert health.readyz() == (False, {"status": "not ready", "reason": health.problems[0]})
        assert delays == [0.05, 0.1]  # backing off ...
        assert check.check_once() == check._interval  # ... until one read answers (the fake's CRD): then periodic
    assert health.problems == [] and health.readyz()[0] and check.checked
    assert sum("cannot read the CRD" in e["event"] for e in logs) == 2
    fake.set_down(True)  # a failed read after a good one keeps the verdict
    try:
        check.check_once()
    finally:
        fake.set_down(False)
    assert health.problems == [] and health.readyz()[0]


def test_the_check_runs_on_its_own_until_the_crd_answers_then_follows_an_upgrade(fake: FakeKube) -> None:
    from agent.ops.health import Health

    health = Health(60, 30)
    health.synced()
    fake.delete("customresourcedefinitions", CRD_NAME)
    fake.fail_next(3, status=503, verb="get")  # absent (404) after these, until set_crd
    check = crd_check(fake, health, interval=0.1).start()
    try:
        wait(lambda: sum(r.verb == "get" for r in fake.requests) >= 5, what="reads until one succeeds")
        assert "HTTP 404" in health.problems[0] and not health.readyz()[0]
        fake.set_crd(crd_with(BASE_FIELDS))  # kube-ovn without share DNAT
        wait(lambda: any("spec.type" in p for p in health.problems), what="the old schema's verdict")
        assert not any("not checked" in p for p in health.problems)
        fake.set_crd(crd_with(SHARE_FIELDS))
        wait(lambda: health.readyz()[0], what="kube-ovn upgraded: ready without a restart")
        assert health.problems == []
    finally:
        check.stop()


PAGED = WatchSettings(**{**FAST.__dict__, "list_page_size": 100})


def _many(fake: FakeKube, n: int) -> None:
    fake.create(EIPS, eip("eip-web", "172.18.0.10"))
    for i in range(n):
        fake.create(RULES, rule(f"r{i}", 1000 + i, "10.0.1.11"))


def test_lists_come_in_pages_of_one_consistent_version(fake: FakeKube) -> None:
    _many(fake, 250)
    src = KubeSource(api_client(fake), PAGED)
    src.start()
    try:
        wait(lambda: src.ready, what="paged lists")
        assert len(services(src)) == 250
        pages = [r for r in fake.requests if r.verb == "list" and r.resource == RULES]
        assert [p.query.get("limit") for p in pages] == ["100"] * 3
        assert [bool(p.query.get("continue")) for p in pages] == [False, True, True]
        # Ready once listed; the watch from the list's version starts right after (a race
        # the test lost once in CI when it looked at once).
        watch = wait(lambda: next((r for r in fake.requests if r.verb == "watch" and r.resource == RULES), None),
                     what="the watch")
        assert watch.query["resourceVersion"] == fake.resource_version
    finally:
        src.stop()


def test_a_list_whose_continue_expires_between_pages_starts_again(fake: FakeKube) -> None:
    _many(fake, 250)
    src = KubeSource(api_client(fake), PAGED)
    real = src._listers[RULES]
    calls = []

    def list_then_compact(**kwargs: Any) -> Any:
        answer = real(**kwargs)
        calls.append(kwargs.get("_continue"))
        if len(calls) == 1:
            fake.delete(RULES, "r249")  # a change the stale pages would miss ...
            fake.compact()  # ... and the first page's version is compacted away
        return answer

    src._listers[RULES] = list_then_compact
    src.start()
    try:
        wait(lambda: src.ready, what="lists after the expired continue")
        assert len(services(src)) == 249  # the stale pages would have kept r249
        pages = [r for r in fake.requests if r.verb == "list" and r.resource == RULES]
        assert [bool(p.query.get("continue")) for p in pages] == [False, True, False, True, True]
    finally:
        src.stop()


def test_rbac_grants_exactly_what_the_agent_used() -> None:
    """Runs last in this module: every request above is allowed, and no grant went unused."""
    docs = list(yaml.safe_load_all((ROOT / "images" / "kubernetes" / "rbac.yaml").read_text()))
    grants: set[tuple[str, str | None, str, str]] = set()  # (group, namespace or None, resource, verb)
    for doc in docs:
        if doc["kind"] not in ("ClusterRole", "Role"):
            continue
        namespace = doc["metadata"].get("namespace") if doc["kind"] == "Role" else None
        for r in doc["rules"]:
            grants |= {(g, namespace, res, v) for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}
    assert SEEN, "the tests above made no request"
    used = set()
    for req in SEEN:
        cluster = (req.api_group, None, req.resource, req.verb)
        local = (req.api_group, req.namespace, req.resource, req.verb)
        assert cluster in grants or (req.namespace and local in grants), f"not allowed: {req.verb} {req.path}"
        used.add(cluster if cluster in grants else local)
    assert used == grants, f"granted but never used: {grants - used}"
