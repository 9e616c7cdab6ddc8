"""Health: the endpoints' transitions."""
from __future__ import annotations

from agent.ops.health import Health


def test_health_endpoints_transitions() -> None:
    now = [100.0]
    health = Health(stale_after=60, wedged_after=30, clock=lambda: now[0])
    assert health.readyz() == (False, {"status": "not ready", "reason": "no full sync yet"})
    health.pending()
    now[0] += 61
    ok, body = health.healthz()
    assert not ok and "waited 61.0s" in body["reason"]
    health.synced()
    assert health.healthz()[0] and health.readyz()[0]
    health.beat()
    now[0] += 31
    ok, body = health.livez()
    assert not ok and body["status"] == "wedged"
    health.beat()
    assert health.livez()[0]


def test_liveness_wakes_an_idle_loop_and_judges_by_whether_it_turns() -> None:
    """No heartbeat timer: asked, a loop asleep for long is poked; one that turns is live,
    a wedged one (nobody beats) is not, after at most half a second."""
    import threading

    now = [100.0]
    health = Health(stale_after=60, wedged_after=30, clock=lambda: now[0])
    health.beat()
    now[0] += 600  # ten minutes asleep with nothing to do
    health.poke = lambda: threading.Thread(target=health.beat).start()  # a loop that turns when woken
    assert health.livez()[0]
    now[0] += 600
    pokes = []
    health.poke = lambda: pokes.append(1)  # a wedged loop: woken, it never turns
    ok, body = health.livez()
    assert not ok and body["status"] == "wedged" and pokes == [1]
