"""Health: the endpoints' transitions."""
from __future__ import annotations

from agent.health import Health


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
