"""The kernel keeps serving the last good state and converges, whatever happens around
the agent: drift in its table, restarts, removed backends with live UDP flows."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from gwtest import APP, BACKENDS, CLIENTS, DNS, DRIFTS, EIP, ROOT, WEB, program, wait_for

@pytest.mark.parametrize("drift", list(DRIFTS))
def test_drift_is_repaired_within_five_seconds(lab, agent, drift):
    program(agent, *WEB, *APP, identities=2)
    assert lab.tcp_connect(EIP, 443, 5)["failed"] == 0
    good = static_ruleset(agent)
    pinned = affinity_entries(agent)
    assert pinned  # the connections to the ClientIP identity pinned their clients
    agent.nft_transaction(DRIFTS[drift])
    # The drift is real (unless repaired already: the agent is quick; then it says so).
    assert static_ruleset(agent) != good or any(e.get("event", "").startswith("drift") for e in agent.logs())
    wait_for(lambda: static_ruleset(agent) == good, 5, what=f"repair after: {drift}")
    if drift.startswith("backend map"):  # repaired in place: the table (and its affinity) stayed
        assert affinity_entries(agent) == pinned
    assert lab.tcp_connect(EIP, 80, 20)["failed"] == 0 and lab.tcp_connect(EIP, 443, 20)["failed"] == 0
    assert any(e.get("event", "").startswith("drift") for e in agent.logs())


def test_someone_elses_table_is_not_drift(lab, agent):
    program(agent, *WEB, identities=1)
    agent.nft("add", "table", "ip", "other")  # moves the ruleset generation
    agent.nft("add", "chain", "ip", "other", "drift_me_not")
    # Then real drift in the agent's table. Notifications arrive in commit order, so once
    # this one is repaired the agent has seen the other table's too: no fixed wait needed.
    agent.nft_transaction(DRIFTS["map element deleted"])
    wait_for(lambda: [e for e in agent.logs() if e.get("event", "").startswith("drift")], 5, what="the repair")
    drift = [e for e in agent.logs() if e.get("event", "").startswith("drift")]
    assert len(drift) == 1, drift  # the agent's own change only, repaired once
    named = {*drift[0].get("chains", []), *drift[0].get("sets", []), *drift[0].get("maps", [])}
    assert named and "drift_me_not" not in named, drift  # the other table's chain was never taken for the agent's
    assert "table ip other" in agent.nft("list", "tables")  # never touched


def affinity_entries(agent) -> set[str]:
    """The clients pinned in the affinity sets, as set . element."""
    entries = set()
    for item in json.loads(agent.nft("-j", "list", "table", "ip", "natgw"))["nftables"]:
        body = item.get("set", {})
        if body.get("name", "").startswith("aff_"):
            for elem in body.get("elem", []):
                value = elem["elem"]["val"] if isinstance(elem, dict) and "elem" in elem else elem
                entries.add(f"{body['name']} {json.dumps(value, sort_keys=True)}")
    return entries


def static_ruleset(agent) -> list[str]:
    """The whole ruleset without handles, counters and dynamic set contents (affinity
    entries come and go with traffic; a recreated set starts empty), in a canonical
    order (a recreated object is listed last)."""
    items = []
    for item in json.loads(agent.nft("-j", "-s", "list", "ruleset"))["nftables"]:
        kind, body = next(iter(item.items()))
        if kind == "metainfo":
            continue
        # nft 1.1.7 lists a set's "count" (elements held) beside "elem": contents too.
        body = {k: v for k, v in body.items() if k != "handle" and not (kind == "set" and k in ("elem", "count"))}
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


def load(lab, *args: str) -> subprocess.Popen:
    return lab.popen_in(lab.client_ns, [sys.executable, str(ROOT / "netns-tests" / "scripts" / "loadgen.py"), *map(str, args)],
                        stdout=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_restart_in_place_drops_no_connection(lab, agent, how):
    program(agent, *WEB, *APP, identities=2)
    warm = lab.tcp_connect(EIP, 443, 40, sources=CLIENTS)  # pin every client first
    assert warm["failed"] == 0
    pinned_before = affinity_entries(agent)
    assert len(pinned_before) == len(CLIENTS)
    traffic = load(lab, "tcp", 4.0, EIP, 80, 443)
    time.sleep(1.0)
    assert agent.stop(how) in (0, -signal.SIGKILL)
    time.sleep(0.5)  # no agent at all for a while: the kernel serves on its own
    agent.start()
    result = finish(traffic)
    assert result["failures"] == [] and result["connections"] > 200, result["failures"][:5]
    assert set(result["answers"]["80"]) == set(BACKENDS)
    # ClientIP held through the restart: each client stayed on the backend it had.
    for client, backends in result["pinned"]["443"].items():
        assert backends == sorted(b for b, n in warm["by_source"][client].items() if n), client
    assert pinned_before <= affinity_entries(agent)  # the entries survived, none was flushed
    wait_for(lambda: len([e for e in agent.logs() if e.get("event") == "starting"]) == 2, what="the restart")
    time.sleep(0.5)
    assert agent.proc.poll() is None


def test_removed_backend_udp_flow_is_rebalanced_and_tcp_flows_stay(lab, agent):
    program(agent, *WEB, *DNS, identities=2)
    tcp = lab.tcp_connect(EIP, 80, 30)  # TIME_WAIT entries to every backend
    assert tcp["failed"] == 0
    sender = load(lab, "udp", 4.0, EIP, 53, 40053)  # one flow: one source port throughout
    started = time.monotonic()
    flow = wait_for(lambda: conntrack(lab, "udp", 53, None, source_port=40053), what="the UDP flow")
    pinned = next(name for name, ip in BACKENDS.items() if f"src={ip}" in flow)
    flows_before = {name: conntrack(lab, "tcp", 80, ip) for name, ip in BACKENDS.items()}
    program(agent, *WEB, *[d for d in DNS if d["spec"]["internalIp"] != BACKENDS[pinned]], identities=2)
    wait_for(lambda: f'"dns-{pinned}"' not in agent.nft("list", "table", "ip", "natgw"), what="the removal")
    assert time.monotonic() - started < 3.0, "too slow to judge the last second of the flow"
    answers = finish(sender)["answers"]
    assert any(backend == pinned for t, backend in answers if t < 0.5)  # it was on that backend
    late = [backend for t, backend in answers if t > 3.0]
    assert late and pinned not in late, (pinned, answers[-10:])  # re-balanced, not stuck
    # TCP entries to the surviving backends are untouched.
    for name, ip in BACKENDS.items():
        if name != pinned:
            assert conntrack(lab, "tcp", 80, ip) == flows_before[name], name


def conntrack(lab, proto: str, port: int, reply_src: str | None, source_port: int | None = None) -> str | int:
    argv = ["conntrack", "-L", "-p", proto, "--orig-dst", EIP, "--dport", str(port)]
    if reply_src:
        argv += ["--reply-src", reply_src]
    if source_port:
        argv += ["--sport", str(source_port)]
    out = lab.run_in(lab.gw_ns, argv, capture_output=True, text=True).stdout
    return out if source_port else len(out.splitlines())
