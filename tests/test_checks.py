"""Health checks, the pure half (agent/core/health.py) and what the planner does with a
down backend (agent/run/planner.py): the annotation's grammar and its errors, rise and
fall, fail open, and the rendered table without the backend that is down."""
from __future__ import annotations

import pytest

from agent.core.desired import ListCatalog
from agent.core.health import ANNOTATION, DEFAULT, FIELD, Check, Tracker, load, parse, target, usable
from agent.core.model import Backend, manifest
from agent.kernel.caps import UNPROBED
from agent.run.planner import Planner
from agent.settings import Settings

B1, B2, B3 = Backend("10.0.1.11", 8080), Backend("10.0.1.12", 8080), Backend("10.0.1.13", 8080)


def test_an_empty_annotation_takes_the_default_for_tcp_and_none_for_udp() -> None:
    assert parse("", "tcp") == DEFAULT
    assert parse("", "udp") is None
    assert parse("", "tcp", None) is None  # settings.health_checks off
    assert parse("off", "tcp") is None


def test_the_annotation_sets_kind_and_values() -> None:
    check = parse("http path=/healthz status=204 interval=2s timeout=500ms rise=1 fall=5 port=8081", "tcp")
    assert check == Check("http", 2.0, 0.5, 1, 5, "/healthz", 204, 8081)
    assert parse("interval=3", "udp") == Check(interval=3.0)  # a UDP backend checked only when asked
    assert parse("tcp", "tcp", Check(interval=5.0)) == Check(interval=5.0)  # unset values from the default


@pytest.mark.parametrize("text, reason", [
    ("ping", "is not off, tcp or http"),
    ("tcp interval=0", "not a duration"),
    ("tcp interval=2h", "not a duration"),
    ("tcp rise=0", "not an integer in 1..100"),
    ("tcp status=200", "for http checks"),
    ("http path=healthz", "absolute path"),
    ("tcp path=/x", "absolute path"),
    ("tcp fall=3 fall=4", "given once"),
    ("tcp colour=blue", "is not one of"),
    ("tcp interval=1 timeout=2", "longer than interval"),
])
def test_a_bad_annotation_says_why(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse(text, "tcp")


def test_rise_and_fall_count_results_in_a_row_and_an_alternating_backend_does_not_flap() -> None:
    t = target(B1, DEFAULT)
    tracker = Tracker(now=0.0)
    tracker.keep([t])
    assert [tracker.observe(t, False, "refused", n) for n in (1, 2, 3)] == [False, False, True]
    assert tracker.down() == {t} and tracker.states[t].since == 3 and tracker.states[t].last_failure == "refused"
    assert [tracker.observe(t, True, "", n) for n in (4, 5)] == [False, True]
    assert not tracker.down()
    flips = [tracker.observe(t, n % 2 == 0, "" if n % 2 == 0 else "refused", n) for n in range(6, 40)]
    assert not any(flips) and not tracker.down()  # one failure in two never makes three in a row
    tracker.keep([])
    assert tracker.observe(t, False, "x", 50) is False and not tracker.states  # a dropped target is forgotten


def test_a_check_on_another_port_is_its_own_target() -> None:
    assert target(B1, Check(port=9000)) == (Backend("10.0.1.11", 9000), Check(port=9000))


def test_usable_leaves_out_what_is_down_but_never_everything() -> None:
    down = frozenset({target(B2, DEFAULT)})
    assert usable((B1, B2, B3), (DEFAULT,) * 3, down) == (B1, B3)
    assert usable((B1, B2, B3), (DEFAULT, None, DEFAULT), down) == (B1, B2, B3)  # B2 unchecked here
    all_down = frozenset(target(b, DEFAULT) for b in (B1, B2, B3))
    assert usable((B1, B2, B3), (DEFAULT,) * 3, all_down) == (B1, B2, B3)  # fail open


def _objects(*rules: tuple[str, Backend, str | None], port: dict[str, int] | None = None) -> ListCatalog:
    """Share rules of one EIP, on port 80 unless `port` (rule name -> port) says otherwise."""
    eip = {"kind": "IptablesEIP", "metadata": {"name": "e"}, "spec": {"v4ip": "172.18.0.10", "natGwDp": "gw1"}}
    docs = [eip]
    for name, backend, note in rules:
        meta: dict[str, object] = {"name": name}
        if note is not None:
            meta["annotations"] = {ANNOTATION: note}
        docs.append({"kind": "IptablesDnatRule", "metadata": meta,
                     "spec": {"eip": "e", "externalPort": str((port or {}).get(name, 80)), "protocol": "tcp",
                              "internalIp": backend.ip, "internalPort": str(backend.port), "type": "share"}})
    return ListCatalog([m for d in docs if (m := manifest(d)) is not None])


def test_a_bad_annotation_refuses_its_rule_naming_the_field_and_nothing_else() -> None:
    planner = Planner(Settings(gateway="gw1"), UNPROBED)
    planner.whole(_objects(("r1", B1, None), ("r2", B2, "tcp fall=many")), None)
    (err,) = planner.state.errors
    assert (err.name, err.field) == ("r2", FIELD) and "fall='many'" in err.reason
    assert [s.backends for s in planner.state.services.values()] == [(B1,)]


def _backends_rendered(change) -> set[Backend]:  # type: ignore[no-untyped-def]
    return {e for name, elems in change.wanted.elements.items() if name.startswith("backend_") for e in elems.values()}


def test_a_down_backend_leaves_the_rendered_table_and_its_identity_is_rendered_again() -> None:
    planner = Planner(Settings(gateway="gw1"), UNPROBED)
    catalog = _objects(("r1", B1, None), ("r2", B2, None), ("r3", B3, "off"))
    full = planner.whole(catalog, None)
    assert _backends_rendered(full) == {B1, B2, B3}
    assert set(planner.targets) == {target(B1, DEFAULT), target(B2, DEFAULT)} and planner.targets_changed
    planner.commit(full)
    planner.targets_changed = False  # the checks were told (Reconciler.take_targets)
    assert planner.set_down(frozenset({target(B2, DEFAULT)})) == 1
    again = planner.partial(catalog, [], full.wanted)
    assert _backends_rendered(again) == {B1, B3}
    assert not planner.targets_changed  # B2 is still checked: the prober is not told again
    assert planner.backends(next(iter(planner.state.services))) == (B1, B2, B3)  # conntrack keeps B2's flows
    assert planner.failing_open() == []
    planner.commit(again)
    assert planner.set_down(frozenset({target(B1, DEFAULT), target(B2, DEFAULT)})) == 1
    assert _backends_rendered(planner.partial(catalog, [], full.wanted)) == {B3}  # B3 is not checked
    assert planner.failing_open() == []
    # With B3 checked too and all three down, all three stay.
    catalog = _objects(("r1", B1, None), ("r2", B2, None), ("r3", B3, None))
    planner.set_down(frozenset(target(b, DEFAULT) for b in (B1, B2, B3)))
    assert _backends_rendered(planner.whole(catalog, None)) == {B1, B2, B3}
    assert [str(i) for i in planner.failing_open()] == ["172.18.0.10:80/tcp"]


def test_which_identities_a_target_serves_follows_partial_changes() -> None:
    """The planner's index from target to identities (built at the first health change,
    then kept in step): what a transition re-renders, fails open and names in its Events."""
    planner = Planner(Settings(gateway="gw1"), UNPROBED)
    ports = {"b1": 81, "b2": 81}
    full = planner.whole(_objects(("a1", B1, None), ("a2", B3, None), ("b1", B1, None), ("b2", B2, None), port=ports),
                         None)
    planner.commit(full)
    t1, t2, t3 = (target(b, DEFAULT) for b in (B1, B2, B3))
    assert planner.set_down(frozenset({t1})) == 2  # B1 serves both identities
    assert planner.rules_checking([t1, t2]) == {t1: ["a1", "b1"], t2: ["b2"]}
    changed = _objects(("a1", B1, None), ("a2", B3, None), ("b1", B1, None), ("b2", B3, None), port=ports)
    planner.commit(planner.partial(changed, [("IptablesDnatRule", "b2")], full.wanted))
    assert planner.set_down(frozenset({t1, t2})) == 0  # B2 serves nothing now
    assert planner.rules_checking([t3]) == {t3: ["a2", "b2"]}
    assert planner.set_down(frozenset({t1, t3})) == 2
    assert [str(i) for i in planner.failing_open()] == ["172.18.0.10:80/tcp", "172.18.0.10:81/tcp"]
    planner.commit(planner.partial(_objects(("a1", B1, None), ("a2", B3, None), ("b1", B1, None), ("b2", B2, None),
                                            port=ports), [("IptablesDnatRule", "b2")], full.wanted))
    assert [str(i) for i in planner.failing_open()] == ["172.18.0.10:80/tcp"]  # :81 has B2 up again
    assert planner.rules_checking([t3]) == {t3: ["a2"]}


class _FakeProber:
    stretch = 1.0

    def __init__(self, report) -> None:  # type: ignore[no-untyped-def]
        self.report = report
        self.targets: frozenset = frozenset()

    def set_targets(self, targets) -> None:  # type: ignore[no-untyped-def]
        self.targets = frozenset(targets)

    def start(self) -> None: ...
    def stop(self) -> None: ...


def test_results_are_counted_where_they_arrive_and_only_a_transition_wakes_the_loop() -> None:
    from agent.run.checks import HealthChecks

    wakes: list[int] = []
    checks = HealthChecks(_FakeProber, clock=lambda: 100.0)
    checks.wake = lambda: wakes.append(1)
    t = target(B1, DEFAULT)
    checks.follow([t])
    assert checks.prober.targets == {t}
    # Between states (failures against an up target, short of `fall`) the prober is told to
    # check again soon; at the change, and on a result that agrees with the state, not.
    assert [checks.prober.report(t, False, "connection refused") for _ in range(2)] == [True, True]
    assert not wakes and checks.drain() == []
    assert checks.prober.report(t, False, "connection refused") is False
    assert len(wakes) == 1
    ((which, state),) = checks.drain()
    assert which == t and not state.up and checks.down() == {t} and checks.counts() == (0, 1)
    snapshot = checks.snapshot()
    (row,) = snapshot["targets"]
    assert row == {"backend": "10.0.1.11:8080", "check": str(DEFAULT), "up": False, "since": 100.0, "checks": 3,
                   "lastFailure": "connection refused", "failedAt": 100.0}
    assert load(snapshot["down"], Backend) == [t]  # what `natgw-agent diff` plans with
    assert checks.prober.report(t, False, "connection refused") is False  # down and failing: settled
    assert checks.prober.report(t, True, "") is True  # one pass of `rise` 2


def test_metrics_count_transitions_and_keep_a_down_series_only_while_down() -> None:
    from agent.ops.metrics import Metrics

    m = Metrics()
    m.health_transition("10.0.1.11:8080", str(DEFAULT), up=False)
    m.health_targets(2.5, 3, 1)
    text = m.exposition().decode()
    assert 'natgw_backend_down{backend="10.0.1.11:8080"' in text
    assert 'natgw_health_transitions_total{to="down"} 1.0' in text
    assert 'natgw_health_targets{state="down"} 1.0' in text and "natgw_health_interval_stretch 2.5" in text
    m.health_transition("10.0.1.11:8080", str(DEFAULT), up=True)
    m.health_transition("10.0.1.12:8080", str(DEFAULT), up=True)  # down before a restart: no series to remove
    text = m.exposition().decode()
    assert "natgw_backend_down{" not in text and 'natgw_health_transitions_total{to="up"} 2.0' in text


def test_a_restarted_agent_starts_with_what_the_last_run_found_down(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from agent.run.checks import HealthChecks

    path = tmp_path / "health-down.json"
    first = HealthChecks(_FakeProber, remember=path)
    http = target(B2, Check("http", port=9000))
    first.follow([target(B1, DEFAULT), http])
    for _ in range(3):
        first.prober.report(http, False, "HTTP 500 (want 200)")
    first.drain()
    assert not path.exists()  # written by the loop's keep_down, not by drain
    first.keep_down(100.0)
    first.prober.report(target(B1, DEFAULT), False, "refused")  # one more, within KEEP_EVERY: not yet written
    first.prober.report(target(B1, DEFAULT), False, "refused")
    first.prober.report(target(B1, DEFAULT), False, "refused")
    first.drain()
    first.keep_down(101.0)
    again = HealthChecks(_FakeProber, remember=path)
    assert again.down() == {http}  # before any check, and before the first sync asks
    first.keep_down(102.0, force=True)  # the loop's end
    assert HealthChecks(_FakeProber, remember=path).down() == {http, target(B1, DEFAULT)}
    again.follow([target(B1, DEFAULT)])  # no longer configured: forgotten
    assert again.down() == frozenset()
    path.write_text("[[1, 2]]")
    assert HealthChecks(_FakeProber, remember=path).down() == frozenset()  # a broken file is ignored, said
