"""How the agent lives in a kube-ovn gateway pod: its worker killed under load and started
again by `natgw-agent supervise` (the container's main process, which survives), HA
gateways programming each their own table from one source, and nothing listening beyond
loopback by default."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from gwtest import (APP, BACKENDS, CLIENTS, EIP, ROOT, WEB, Agent, agent_status, eip_doc, kernel_table, program,
                    rule_doc, run_agent, wait_for, write_rules, yaml_docs)
from lab.topology import Lab


@pytest.fixture
def supervised(lab: Lab, tmp_path: Path) -> Iterator[Agent]:
    rules = tmp_path / "rules"
    rules.mkdir()
    yield from run_agent(Agent(lab, rules, tmp_path / "agent.log", supervised=True))


def load(lab: Lab, seconds: float) -> subprocess.Popen:
    return lab.popen_in(lab.client_ns, [sys.executable, str(ROOT / "netns-tests" / "scripts" / "loadgen.py"), "tcp",
                                        str(seconds), EIP, "80", "443"], stdout=subprocess.PIPE, text=True)


def worker_pid(agent: Agent) -> int:
    return wait_for(lambda: (agent_status(agent) or {}).get("pid"), 10, 0.1, what="a worker answering")


def test_killing_the_worker_three_times_under_load_fails_no_connection(lab, supervised):
    agent = supervised
    program(agent, *WEB, *APP, identities=2)
    warm = lab.tcp_connect(EIP, 443, 40, sources=CLIENTS)  # pin every client
    assert warm["failed"] == 0
    held = {client: sorted(b for b, n in per.items() if n) for client, per in warm["by_source"].items()}
    assert set(held) == set(CLIENTS) and all(len(b) == 1 for b in held.values()), held  # each pinned to one
    before = kernel_table(lab)
    traffic = load(lab, 9.0)
    pids = []
    for n in range(3):
        time.sleep(1.0)
        pid = worker_pid(agent)
        pids.append(pid)
        os.kill(pid, signal.SIGKILL)
        # A new worker, ready, and programming again: a change made now reaches the kernel.
        wait_for(lambda: (s := agent_status(agent)) and s.get("pid") != pid and s.get("ready"), 10, 0.1,
                 what=f"a new worker ready after kill {n + 1}")
        port = 9090 if n % 2 == 0 else 8080  # b3 moves between its two ports: a real change each time
        write_rules(agent.rules_dir, "rules.yaml",
                    yaml_docs(eip_doc(), *WEB[:2], rule_doc("web-b3", 80, BACKENDS["b3"], port), *APP))
        wait_for(lambda: f"{BACKENDS['b3']} . {port}" in agent.nft("list", "map", "ip", "natgw", "backend_2"), 10, 0.1,
                 what=f"programming after kill {n + 1}")
    result = json.loads(traffic.communicate(timeout=60)[0].strip().splitlines()[-1])
    assert result["failures"] == [] and result["connections"] > 300, result["failures"][:5]
    assert result["pinned"]["443"] == held  # all 20 clients came, each kept its backend through all three kills
    assert set(before["entries"]) <= set(kernel_table(lab)["entries"])
    assert agent.proc.poll() is None, "the supervisor (the container's main process) died"
    assert len(set(pids)) == 3
    restarts = [e for e in agent.logs() if e.get("event") == "supervisor: worker ended; starting it again"]
    assert len(restarts) == 3 and all(e["code"] == -signal.SIGKILL for e in restarts)


def test_sigterm_stops_the_supervisor_and_its_worker_leaving_the_rules(lab, supervised):
    agent = supervised
    program(agent, *WEB, identities=1)
    pid = worker_pid(agent)
    assert agent.stop(signal.SIGTERM) == 0
    assert not os.path.exists(f"/proc/{pid}"), "the worker outlived its supervisor"
    assert kernel_table(lab)["identities"] == 1  # the data plane outlives the process


def test_ha_replicas_each_program_their_own_table_and_a_restart_of_one_leaves_the_other(tmp_path):
    rules = tmp_path / "rules"
    rules.mkdir()
    write_rules(rules, "rules.yaml", yaml_docs(eip_doc(), *WEB, *APP))
    with Lab() as first, Lab() as second:
        agents = [Agent(first, rules, tmp_path / "a.log"), Agent(second, rules, tmp_path / "b.log")]
        for agent in agents:
            agent.start()
        try:
            for lab, agent in zip((first, second), agents):
                agent.wait_services(2)
                assert lab.tcp_connect(EIP, 80, 12)["failed"] == 0 and lab.tcp_connect(EIP, 443, 6)["failed"] == 0
            other = kernel_table(second)
            seen = len(agents[1].logs())
            agents[0].stop(signal.SIGKILL)
            agents[0].start()
            wait_for(lambda: (agent_status(agents[0]) or {}).get("ready"), 10, what="the first replica again")
            assert kernel_table(second) == other  # the other replica's table and pins: untouched
            assert not [e for e in agents[1].logs()[seen:] if e.get("event") in ("synced", "transaction")]
            assert first.tcp_connect(EIP, 80, 12)["failed"] == 0 and second.tcp_connect(EIP, 80, 12)["failed"] == 0
        finally:
            for agent in agents:
                if agent.proc is not None and agent.proc.poll() is None:
                    agent.stop(signal.SIGKILL)


def test_nothing_listens_beyond_loopback_by_default(lab, agent):
    program(agent, *WEB, identities=1)
    assert agent_status(agent)["ready"]
    listening = lab.run_in(lab.gw_ns, ["ss", "-Hltnu"], capture_output=True, text=True, check=True).stdout
    local = [line.split()[4] for line in listening.splitlines() if line.strip()]
    assert local and all(a.startswith(("127.0.0.1:", "[::1]:")) for a in local), local


def test_a_worker_never_outlives_its_supervisor(lab, supervised):
    agent = supervised
    program(agent, *WEB, identities=1)
    pid = worker_pid(agent)
    assert agent.stop(signal.SIGKILL) == -signal.SIGKILL  # no chance to pass anything on
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 5, what="the orphaned worker to end")
