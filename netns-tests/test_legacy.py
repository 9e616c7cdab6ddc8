"""Coexistence with the legacy nat-gateway.sh data plane, and taking it over."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

from gwtest import APP, BACKENDS, EIP, ROOT, WEB, Agent, program, run_agent

B3 = BACKENDS["b3"]


def h(text: str, n: int) -> str:
    return hashlib.md5(text.encode()).hexdigest()[:n]


def legacy_ruleset() -> str:
    """What the legacy script leaves for three identities, all DNATed to b3 only: 80/tcp,
    443/tcp with ClientIP (per-backend timeout set), and 8443/tcp that the agent never
    serves. Text: this reproduces the legacy tool, which feeds nft text."""
    web, app, other = h(f"{EIP}:80:tcp", 12), h(f"{EIP}:443:tcp", 12), h(f"{EIP}:8443:tcp", 12)
    ep = h(f"{B3}:9090", 8)
    return f"""
table ip kube-ovn {{
  map service-ips {{
    type ipv4_addr . inet_proto . inet_service : verdict
    elements = {{ {EIP} . tcp . 80 : goto dnat-{web}, {EIP} . tcp . 443 : goto dnat-{app},
                 {EIP} . tcp . 8443 : goto dnat-{other} }}
  }}
  set aff-{app}-{ep} {{
    type ipv4_addr
    flags timeout
    timeout 600s
  }}
  chain prerouting {{
    type nat hook prerouting priority -150; policy accept;
    ip daddr . meta l4proto . th dport vmap @service-ips
  }}
  chain dnat-{web} {{
    meta l4proto tcp dnat ip addr . port to numgen random mod 1 map {{ 0 : {B3} . 8080 }}
  }}
  chain ep-{app}-{ep} {{
    update @aff-{app}-{ep} {{ ip saddr }}
    meta l4proto tcp dnat to {B3}:9090
  }}
  chain dnat-{app} {{
    ip saddr @aff-{app}-{ep} goto ep-{app}-{ep}
    numgen random mod 1 vmap {{ 0 : goto ep-{app}-{ep} }}
  }}
  chain dnat-{other} {{
    meta l4proto tcp dnat ip addr . port to numgen random mod 1 map {{ 0 : {B3} . 8080 }}
  }}
}}
"""


def test_agent_wins_over_legacy_and_takes_it_over_without_a_failed_connection(lab, agent, tmp_path):
    lab.run_in(lab.gw_ns, ["nft", "-f", "-"], input=legacy_ruleset(), text=True, check=True)
    assert lab.tcp_connect(EIP, 80, 10)["by_backend"]["b3"] == 10  # legacy alone: b3
    program(agent, *WEB[:2], *APP[:2], identities=2)  # agent: b1 and b2 only
    web = lab.tcp_connect(EIP, 80, 40)
    app = lab.tcp_connect(EIP, 443, 20, sources=[f"172.18.0.{i}" for i in range(101, 111)])
    assert web["failed"] == app["failed"] == 0
    assert web["by_backend"]["b3"] == 0 and app["by_backend"]["b3"] == 0  # the agent binds NAT first
    assert "dnat-" in lab.run_in(lab.gw_ns, ["nft", "list", "table", "ip", "kube-ovn"], capture_output=True,
                                 text=True).stdout  # and never touched the legacy table

    # Restart with --take-over-legacy under continuous load.
    load = lab.popen_in(lab.client_ns, [sys.executable, str(ROOT / "netns-tests" / "scripts" / "loadgen.py"), "tcp", "3",
                                        EIP, "80", "443", "8443"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    assert agent.stop() == 0
    takeover = Agent(lab, agent.rules_dir, tmp_path / "takeover.log",
                     source_args=["--from-dir", str(agent.rules_dir), "--take-over-legacy"])
    runner = run_agent(takeover)
    next(runner)
    try:
        out, _ = load.communicate(timeout=30)
        result = json.loads(out.strip().splitlines()[-1])
        assert result["failures"] == [], result["failures"][:5]
        assert set(result["answers"]["80"]) <= {"b1", "b2"} and set(result["answers"]["443"]) <= {"b1", "b2"}
        assert set(result["answers"]["8443"]) == {"b3"}  # not ours: the legacy path still serves it
        legacy = json.loads(lab.run_in(lab.gw_ns, ["nft", "-j", "list", "table", "ip", "kube-ovn"],
                                       capture_output=True, text=True, check=True).stdout)["nftables"]
        names = {next(iter(i.values())).get("name") for i in legacy}
        (service_ips,) = [i["map"] for i in legacy if "map" in i]
        keys = [e[0]["concat"][2] for e in service_ips["elem"]]
        assert keys == [8443]  # only the identity the agent does not serve is left
        assert not {n for n in names if n and (n.startswith("ep-") or n.startswith("aff-"))}
        assert {"prerouting", f"dnat-{h(f'{EIP}:8443:tcp', 12)}"} <= names
        assert not {f"dnat-{h(f'{EIP}:80:tcp', 12)}", f"dnat-{h(f'{EIP}:443:tcp', 12)}"} & names
    finally:
        next(runner, None)
