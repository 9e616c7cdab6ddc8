"""The kernel keeps serving the last good state and converges, whatever happens around
the agent: drift in its table, restarts, removed backends with live UDP flows."""
from __future__ import annotations

import json
import sys
import time

import pytest

from gwtest import APP, EIP, ROOT, WEB, program, wait_for

DRIFTS = {
    "table deleted": [["delete", "table", "ip", "natgw"]],
    "chain flushed": [["flush", "chain", "ip", "natgw", "slot_0"]],
    "map element deleted": [["delete", "element", "ip", "natgw", "addr_1", f"{{ {EIP} . tcp . 80 }}"]],
    "affinity set deleted": [["flush", "chain", "ip", "natgw", "aff_t600_n3"],
                             ["flush", "chain", "ip", "natgw", "sticky_0_t600"],
                             ["delete", "set", "ip", "natgw", "aff_0"]],
}


@pytest.mark.parametrize("drift", list(DRIFTS))
def test_drift_is_repaired_within_five_seconds(lab, agent, drift):
    program(agent, *WEB, *APP, identities=2)
    assert lab.tcp_connect(EIP, 443, 5)["failed"] == 0
    good = static_ruleset(agent)
    for command in DRIFTS[drift]:
        agent.nft(*command)
    assert static_ruleset(agent) != good  # the drift is real
    wait_for(lambda: static_ruleset(agent) == good, 5, what=f"repair after: {drift}")
    assert lab.tcp_connect(EIP, 80, 20)["failed"] == 0 and lab.tcp_connect(EIP, 443, 20)["failed"] == 0
    assert any(e.get("event", "").startswith("drift") for e in agent.logs())


def test_someone_elses_table_is_not_drift(lab, agent):
    program(agent, *WEB, identities=1)
    time.sleep(0.3)
    agent.nft("add", "table", "ip", "other")  # moves the ruleset generation
    agent.nft("add", "chain", "ip", "other", "c")
    time.sleep(2.5)  # two drift checks
    assert not any(e.get("event", "").startswith("drift") for e in agent.logs())
    assert "table ip other" in agent.nft("list", "tables")  # never touched


def static_ruleset(agent) -> list[str]:
    """The whole ruleset without handles, counters and dynamic set contents (affinity
    entries come and go with traffic; a recreated set starts empty), in a canonical
    order (a recreated object is listed last)."""
    items = []
    for item in json.loads(agent.nft("-j", "-s", "list", "ruleset"))["nftables"]:
        kind, body = next(iter(item.items()))
        if kind == "metainfo":
            continue
        body = {k: v for k, v in body.items() if k != "handle" and not (kind == "set" and k == "elem")}
        items.append(json.dumps({kind: body}, sort_keys=True))
    return sorted(items)


def test_cleanup_removes_everything_the_agent_owns_and_nothing_else(lab, agent):
    program(agent, *WEB, identities=1)
    agent.nft("add", "table", "ip", "other")
    assert agent.stop() == 0
    argv = [sys.executable, "-m", "agent.cli", "cleanup"]
    out = lab.run_in(lab.gw_ns, argv, capture_output=True, text=True, cwd=ROOT, check=True)
    assert "removed table ip natgw" in out.stdout
    assert agent.nft("list", "tables").split() == ["table", "ip", "other"]
    again = lab.run_in(lab.gw_ns, argv, capture_output=True, text=True, cwd=ROOT, check=True)
    assert "nothing to remove" in again.stdout
