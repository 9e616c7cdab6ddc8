"""What an operator sees: metrics scraped over HTTP from the running agent after real
traffic, and the JSON log lines."""
from __future__ import annotations

import re

from gwtest import BACKENDS, EIP, WEB, http_get, program, wait_for


def samples(text: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            found[name] = float(value)
    return found


def test_metrics_after_traffic_show_the_spread_per_backend(lab, agent):
    program(agent, *WEB, identities=1)
    assert lab.tcp_connect(EIP, 80, 30)["failed"] == 0

    def scraped() -> tuple[dict[str, float], dict[str, float]]:
        status, text = http_get(lab, "/metrics")
        assert status == 200
        metrics = samples(text)
        return metrics, {b: metrics.get(f'natgw_backend_packets_total{{backend="{ip}:8080",identity="{EIP}:80/tcp"}}', 0)
                         for b, ip in BACKENDS.items()}

    # A scrape answers with the counters last read in the background, and asks for a new
    # reading when that one is old: the next scrapes see the traffic.
    def counted() -> tuple[dict[str, float], dict[str, float]] | None:
        found = scraped()
        return found if sum(found[1].values()) == 30 else None

    metrics, per_backend = wait_for(counted, 5, 0.2, "the counters of the 30 connections")
    assert all(per_backend.values()), per_backend  # one first packet per new connection, on every backend
    assert metrics["natgw_identities"] == 1 and metrics["natgw_backends"] == 3
    assert metrics['natgw_sync_duration_seconds_count{kind="full"}'] >= 1
    assert metrics["natgw_network_programming_duration_seconds_count"] >= 1
    assert metrics["natgw_sync_failures_total"] == 0
    assert metrics["natgw_sync_last_timestamp_seconds"] > 1.7e9


def test_log_lines_are_json_with_the_expected_keys(lab, agent):
    program(agent, *WEB, identities=1)
    logs = agent.logs()
    assert logs and all({"event", "level", "timestamp"} <= set(e) for e in logs)
    synced = [e for e in logs if e["event"] == "synced"]
    assert synced and {"commands", "identities", "backends", "partial"} <= set(synced[-1])
    assert re.match(r"\d{4}-\d\d-\d\dT", synced[-1]["timestamp"])
