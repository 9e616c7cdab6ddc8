"""The agent's whole data path: rules in a directory -> kernel -> real traffic."""
from __future__ import annotations

import json
import subprocess
import sys
import signal
import time

from tests.golden import UPDATE_GOLDEN, nft_text_by_meaning
from gwtest import (APP, BACKENDS, CHI2_CRITICAL_DF2, CLIENTS, DNS, EIP, OTHER_EIP, ROOT, WEB, chi_square, eip_doc,
                    program, rule_doc, wait_for, write_rules, yaml_docs)

def test_tcp_spread_is_uniform_over_three_backends(lab, agent):
    program(agent, *WEB, identities=1)
    spread = lab.scapy_syn_spread(EIP, 80, 600)
    counts = [spread["by_backend"].get(name, 0) for name in BACKENDS]
    assert sum(counts) == 600, spread  # every SYN was DNATed to exactly one backend
    assert chi_square(counts) < CHI2_CRITICAL_DF2, counts
    real = lab.tcp_connect(EIP, 80, 60)
    assert real["failed"] == 0, real
    assert set(real["by_backend"]) == set(BACKENDS) and sum(real["by_backend"].values()) == 60


def test_udp_identity_spreads_and_answers(lab, agent):
    program(agent, *DNS, identities=1)
    result = lab.udp_query(EIP, 53, 90)
    assert result["failed"] == 0, result
    assert all(result["by_backend"].get(n, 0) > 0 for n in BACKENDS), result


def test_clientip_pins_each_client_to_one_backend(lab, agent):
    program(agent, *APP, identities=1)
    one = lab.tcp_connect(EIP, 443, 30, sources=["172.18.0.100"])
    assert one["failed"] == 0 and len([n for n, c in one["by_backend"].items() if c]) == 1, one
    many = lab.tcp_connect(EIP, 443, 60, sources=CLIENTS)
    assert many["failed"] == 0, many
    assert all(len(per) == 1 for per in many["by_source"].values()), many["by_source"]  # each client sticks
    assert len([n for n, c in many["by_backend"].items() if c]) >= 2, many  # 20 clients are spread


def test_removing_a_backend_stops_new_connections_to_it_within_a_second(lab, agent):
    program(agent, *WEB, *APP, identities=2)
    pinned = lab.tcp_connect(EIP, 443, 40, sources=CLIENTS)["by_source"]
    write_rules(agent.rules_dir, "rules.yaml", yaml_docs(eip_doc(), *WEB[:2], *APP[:2]))
    time.sleep(1.0)
    after = lab.tcp_connect(EIP, 80, 60)
    assert after["failed"] == 0 and after["by_backend"].get("b3", 0) == 0, after
    sticky = lab.tcp_connect(EIP, 443, 40, sources=CLIENTS)
    assert sticky["failed"] == 0 and sticky["by_backend"].get("b3", 0) == 0, sticky
    # Clients pinned to a surviving backend keep it: removing b3 emptied only b3's affinity.
    for client, before in pinned.items():
        if "b3" not in before:
            assert set(sticky["by_source"][client]) == set(before), client
    # The emptied pattern chains are deleted by a transaction of their own, a second later.
    wait_for(lambda: "lb_n3" not in agent.nft("list", "chains", "ip"), 3, what="lb_n3 to be retired")
    assert "aff_t600_n3" not in agent.nft("list", "chains", "ip")
    # Adding a backend back moves nobody who is pinned.
    now = lab.tcp_connect(EIP, 443, 40, sources=CLIENTS)["by_source"]
    program(agent, *WEB, *APP, identities=2)
    time.sleep(0.6)
    again = lab.tcp_connect(EIP, 443, 40, sources=CLIENTS)
    assert again["failed"] == 0 and {c: set(p) for c, p in again["by_source"].items()} == {
        c: set(p) for c, p in now.items()}


def test_deleted_identity_no_longer_answers_and_its_flows_are_gone(lab, agent):
    program(agent, *WEB, *DNS, identities=2)
    assert lab.udp_query(EIP, 53, 6)["failed"] == 0
    assert conntrack_count(lab, "udp", 53) > 0
    write_rules(agent.rules_dir, "rules.yaml", yaml_docs(eip_doc(), *WEB))
    agent.wait_services(1)
    wait_for(lambda: conntrack_count(lab, "udp", 53) == 0, 2, what="UDP flows of the deleted identity to go")
    gone = lab.udp_query(EIP, 53, 5, timeout=0.5)
    assert gone["failed"] == 5, gone
    assert lab.tcp_connect(EIP, 80, 10)["failed"] == 0  # the other identity is untouched


def test_invalid_rules_beside_valid_ones(lab, agent):
    bad = [rule_doc("bad-port", 81, "10.0.1.11", 70000), rule_doc("bad-ip", 82, "10.0.1.300"),
           rule_doc("bad-proto", 83, "10.0.1.11", proto="sctp"),
           rule_doc("bad-inject", 84, "10.0.1.11; flush ruleset")]
    write_rules(agent.rules_dir, "bad.yaml", yaml_docs(*bad))
    write_rules(agent.rules_dir, "broken.yaml", "kind: [unclosed")
    program(agent, *WEB, identities=1)
    assert lab.tcp_connect(EIP, 80, 20)["failed"] == 0
    errors = wait_for(lambda: {e["name"]: e["field"] for e in agent.logs() if e.get("event") == "invalid rule left out"}
                      if len([e for e in agent.logs() if e.get("event") == "invalid rule left out"]) >= 4 else None,
                      what="invalid rules to be reported")
    assert errors == {"bad-port": "spec.internalPort", "bad-ip": "spec.internalIp",
                      "bad-proto": "spec.protocol", "bad-inject": "spec.internalIp"}
    # Reported once per change, not on every poll.
    time.sleep(0.6)
    assert len([e for e in agent.logs() if e.get("event") == "invalid rule left out"]) == 4
    assert agent.proc.poll() is None


def test_rules_of_another_gateway_are_ignored(lab, agent):
    other = [rule_doc("other-80", 80, "10.0.1.11", eip="eip-other")]
    write_rules(agent.rules_dir, "other.yaml", yaml_docs(eip_doc("eip-other", OTHER_EIP, "gw2"), *other))
    program(agent, *WEB, identities=1)
    assert list(agent.services()) == [(EIP, "tcp", 80)]
    assert lab.tcp_connect(OTHER_EIP, 80, 3, timeout=0.5)["failed"] == 3


def test_kernel_listing_of_examples_matches_golden(lab, agent):
    for path in (ROOT / "examples").iterdir():
        write_rules(agent.rules_dir, path.name, path.read_text())
    agent.wait_services(3)
    listing = agent.nft("-s", "list", "table", "ip", "natgw")  # -s: no counter values
    golden = ROOT / "rulesets" / "examples.nft"
    if UPDATE_GOLDEN:
        golden.write_text(listing)
    assert nft_text_by_meaning(listing) == nft_text_by_meaning(golden.read_text())


def test_show_reads_the_kernel(lab, agent):
    program(agent, *WEB, *APP, identities=2)
    out = lab.run_in(lab.gw_ns, [*agent_cmd(), "show", "--state-dir", str(agent.state_dir)], capture_output=True,
                     text=True, cwd=ROOT, check=True).stdout
    assert out.startswith("agent: ready; nftables ")  # the running agent's own word, from its status socket
    assert f"{EIP}:80/tcp  affinity none (random)" in out
    assert f"{EIP}:443/tcp  affinity ClientIP timeout 600s" in out
    assert "rules: app-b1,app-b2,app-b3" in out
    assert "-> 10.0.1.12:9090  slot 1  new connections 0 (0%)  pinned clients 0" in out


def test_show_counts_connections_and_pinned_clients_as_json_and_filters(lab, agent):
    program(agent, *WEB, *APP, identities=2)
    sticky = lab.tcp_connect(EIP, 443, 20, sources=CLIENTS[:10])
    assert sticky["failed"] == 0
    argv = [*agent_cmd(), "show", "--json", "--identity", f"{EIP}:443/tcp", "--state-dir", str(agent.state_dir)]
    doc = json.loads(lab.run_in(lab.gw_ns, argv, capture_output=True, text=True, cwd=ROOT, check=True).stdout)
    (shown,) = doc["identities"]
    caps = doc["agent"]["capabilities"]  # what the agent probed at start
    assert caps["nft_version"] == agent.nft("--version").split()[1].lstrip("v") and caps["kernel"]
    assert caps["json_concat_maps"] is (caps["nft_version"] >= "1.1")
    assert shown["identity"] == f"{EIP}:443/tcp" and shown["affinity"] == "ClientIP" and shown["timeout"] == 600
    by_ip = {b["backend"].split(":")[0]: b for b in shown["backends"]}
    for name, ip in BACKENDS.items():
        clients = [c for c, per in sticky["by_source"].items() if sum(per.values()) and per.get(name)]
        assert by_ip[ip]["pinned_clients"] == len(clients), name  # one entry per pinned client
        assert by_ip[ip]["packets"] == sticky["by_backend"][name], name  # one first packet per connection
    assert sum(b["pinned_clients"] for b in shown["backends"]) == 10


def test_diff_is_empty_when_converged_and_shows_drift(lab, agent):
    program(agent, *WEB, identities=1)
    argv = [*agent_cmd(), "diff", "--gateway", "gw1", "--from-dir", str(agent.rules_dir)]
    converged = lab.run_in(lab.gw_ns, argv, capture_output=True, text=True, cwd=ROOT)
    assert (converged.returncode, converged.stdout) == (0, "")
    assert agent.stop() == 0  # no one to repair it
    agent.nft("delete", "element", "ip", "natgw", "backend_1", f"{{ {EIP} . tcp . 80 }}")
    drift = lab.run_in(lab.gw_ns, argv, capture_output=True, text=True, cwd=ROOT)
    assert drift.returncode == 1
    (command,) = json.loads(drift.stdout)["nftables"]  # exactly the missing element, back
    assert command["add"]["element"]["name"] == "backend_1"


def test_render_text_is_the_kernels_own_listing(lab):
    argv = [*agent_cmd(), "render", "--text", "--gateway", "gw1", "--from-dir", str(ROOT / "examples")]
    out = lab.run_in(lab.gw_ns, argv, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    # The golden listing taken from the kernel (by meaning: the order of elements is nft's own).
    assert nft_text_by_meaning(out) == nft_text_by_meaning((ROOT / "rulesets" / "examples.nft").read_text())
    assert lab.run_in(lab.gw_ns, ["nft", "list", "tables"], capture_output=True, text=True).stdout == ""


def test_sigterm_leaves_rules_and_restart_sends_nothing(lab, agent):
    program(agent, *WEB, *APP, identities=2)
    assert lab.tcp_connect(EIP, 443, 5, sources=CLIENTS[:5])["failed"] == 0
    before = agent.nft("-s", "list", "table", "ip", "natgw")
    synced = len([e for e in agent.logs() if e.get("event") == "synced"])
    assert agent.stop(signal.SIGTERM) == 0
    assert agent.nft("-s", "list", "table", "ip", "natgw") == before  # the data plane outlives the process
    assert lab.tcp_connect(EIP, 80, 10)["failed"] == 0
    agent.start()
    wait_for(lambda: len([e for e in agent.logs() if e.get("event") == "starting"]) == 2, what="restart")
    time.sleep(1.0)
    assert agent.nft("-s", "list", "table", "ip", "natgw") == before
    # The restarted agent read the kernel back and found nothing to send.
    assert len([e for e in agent.logs() if e.get("event") == "synced"]) == synced


def conntrack_count(lab, proto: str, port: int) -> int:
    out = lab.run_in(lab.gw_ns, ["conntrack", "-L", "-p", proto, "--orig-dst", EIP, "--dport", str(port)],
                     capture_output=True, text=True)
    return len([line for line in out.stdout.splitlines() if line.strip()])


def agent_cmd() -> list[str]:
    import sys

    return [sys.executable, "-m", "agent.cli", "--log-format", "console"]


def test_render_touches_nothing(lab):
    argv = [*agent_cmd(), "render", "--gateway", "gw1", "--from-dir", str(ROOT / "examples")]
    out = lab.run_in(lab.gw_ns, argv, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert json.loads(out)["nftables"][0] == {"add": {"table": {"family": "ip", "name": "natgw"}}}
    assert lab.run_in(lab.gw_ns, ["nft", "list", "tables"], capture_output=True, text=True).stdout == ""


OWNER = ("import nftables, sys\n"
         "nft = nftables.Nftables()\n"
         "assert nft.cmd('add table ip natgw { flags owner; }')[0] == 0\n"
         "print('held', flush=True)\n"
         "sys.stdin.read()\n")


def test_refused_transaction_changes_nothing_is_logged_and_retried(lab, agent):
    """The kernel refuses every transaction while another process owns a table of the
    agent's name (`flags owner`: only its socket may change it, and the table goes with
    that socket): refusals change nothing, are logged, and are retried until they land."""
    program(agent, *DNS, identities=1)
    assert agent.stop() == 0
    agent.nft("delete", "table", "ip", "natgw")
    holder = lab.popen_in(lab.gw_ns, [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)
    assert holder.stdout.readline().strip() == "held"
    held = agent.nft("-s", "list", "table", "ip", "natgw")
    agent.start()
    failed = wait_for(lambda: [e for e in agent.logs() if e.get("event", "").startswith("apply failed")],
                      what="the refused transaction to be logged")
    assert failed[0]["rc"] != 0 and len(failed[0]["digest"]) == 12 and "not permitted" in failed[0]["error"]
    assert failed[0]["kernel_unchanged"] is True
    assert agent.nft("-s", "list", "table", "ip", "natgw") == held  # nothing of it went in
    holder.stdin.close()  # the owner goes, and its table with it
    holder.wait(5)
    wait_for(lambda: agent.services().get((EIP, "udp", 53)) == "lb_n3", 10, what="convergence after retry")
    assert lab.udp_query(EIP, 53, 10)["failed"] == 0


def test_affinity_timeout_slides_with_each_new_connection(lab, agent):
    program(agent, *[rule_doc(f"short-{n}", 443, ip, 9090, affinity="ClientIP", timeout=3)
                     for n, ip in BACKENDS.items()], identities=1)

    def remaining() -> float:
        out = agent.nft("-j", "list", "table", "ip", "natgw")
        for item in json.loads(out)["nftables"]:
            for elem in item.get("set", {}).get("elem", []):
                if isinstance(elem, dict) and elem["elem"]["val"]["concat"][0] == "172.18.0.100":
                    return elem["elem"]["expires"]
        return 0.0

    first = lab.tcp_connect(EIP, 443, 1)["by_backend"]
    for _ in range(3):  # 4.5 s in all, longer than the timeout, one connection every 1.5 s
        time.sleep(1.5)
        assert lab.tcp_connect(EIP, 443, 1)["by_backend"] == first
        assert remaining() >= 2  # (whole seconds) restarted by this connection, not run down from the first
    time.sleep(3.5)
    assert remaining() == 0.0  # expired once the client stopped


def test_unreadable_rules_directory_at_start_keeps_the_kernel_state(lab, agent):
    program(agent, *WEB, identities=1)
    before = agent.nft("-s", "list", "table", "ip", "natgw")
    assert agent.stop() == 0
    hidden = agent.rules_dir.with_name("hidden")
    agent.rules_dir.rename(hidden)
    agent.start()
    wait_for(lambda: any(e.get("event") == "cannot read rules directory" for e in agent.logs()), what="the error")
    time.sleep(0.5)
    assert agent.nft("-s", "list", "table", "ip", "natgw") == before
    assert lab.tcp_connect(EIP, 80, 10)["failed"] == 0
    hidden.rename(agent.rules_dir)
    write_rules(agent.rules_dir, "rules.yaml", yaml_docs(eip_doc(), *WEB[:1]))
    wait_for(lambda: lab.tcp_connect(EIP, 80, 6)["by_backend"]["b1"] == 6, what="convergence once readable")


def test_removed_backend_loses_only_its_own_clients_affinity(lab, agent):
    # Two ClientIP identities share the per-slot affinity sets; b3 (slot 2) leaves one.
    app2 = [rule_doc(f"app2-{n}", 8443, ip, 9090, affinity="ClientIP", timeout=600) for n, ip in BACKENDS.items()]
    program(agent, *APP, *app2, identities=2)
    for port in (443, 8443):
        assert lab.tcp_connect(EIP, port, 40, sources=CLIENTS)["failed"] == 0

    def entries(port: int) -> int:
        listing = json.loads(agent.nft("-j", "list", "set", "ip", "natgw", "aff_2"))["nftables"]
        return sum(1 for i in listing if "set" in i for e in i["set"].get("elem", [])
                   if e["elem"]["val"]["concat"][3] == port)

    on_b3 = entries(443), entries(8443)
    assert on_b3[0] > 0 and on_b3[1] > 0  # 20 clients over 3 backends: some on b3 for both
    program(agent, *APP[:2], *app2, identities=2)
    wait_for(lambda: entries(443) == 0, 3, what="443's entries on b3 to go")
    assert entries(8443) == on_b3[1]  # the other identity's clients on b3 keep theirs


def test_a_replaced_clientip_backend_leaves_the_newcomers_pins_alone(lab, agent):
    """b1 is replaced by b3 in one change. b3 takes a slot b1 never held, so b1's clients,
    still pinned in b1's slot until the cleanup deletes them, are never sent to b3; and
    the cleanup, which deletes them, never takes the pins b3's clients made meanwhile."""
    app2 = [rule_doc(f"app2-{n}", 8443, ip, 9090, affinity="ClientIP", timeout=600) for n, ip in BACKENDS.items()]
    program(agent, *APP[:2], *app2, identities=2)  # :443 on b1 (slot 0) and b2 (slot 1); :8443 keeps aff_0 in use
    assert lab.tcp_connect(EIP, 443, 40, sources=CLIENTS)["failed"] == 0

    def entries(slot: int, port: int) -> set[str]:
        listing = json.loads(agent.nft("-j", "list", "set", "ip", "natgw", f"aff_{slot}"))["nftables"]
        return {e["elem"]["val"]["concat"][0] for i in listing if "set" in i for e in i["set"].get("elem", [])
                if e["elem"]["val"]["concat"][3] == port}

    on_b1 = entries(0, 443)
    assert on_b1  # 20 clients over 2 backends: some on b1
    program(agent, APP[1], APP[2], *app2, identities=2)  # b1 out, b3 in: one change
    newcomers = [f"172.18.0.{i}" for i in range(121, 141)]
    fresh = lab.tcp_connect(EIP, 443, 40, sources=newcomers)  # new clients, some pinned to b3 at once
    assert fresh["failed"] == 0 and fresh["by_backend"]["b3"] > 0, fresh
    wait_for(lambda: not entries(0, 443), 5, what="b1's clients' pins to go")
    assert "aff_t600_s1.2" in agent.nft("list", "table", "ip", "natgw")  # b3 in slot 2, not b1's 0
    on_b3 = {c for c, per in fresh["by_source"].items() if "b3" in per}
    assert on_b3 <= entries(2, 443)  # every newcomer on b3 is still pinned there
    again = lab.tcp_connect(EIP, 443, 20, sources=sorted(on_b3))
    assert again["failed"] == 0 and set(n for n, c in again["by_backend"].items() if c) == {"b3"}
