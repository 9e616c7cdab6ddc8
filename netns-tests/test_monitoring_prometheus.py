"""The shipped alerts and dashboard (images/kubernetes/monitoring/) against a real
Prometheus (Debian's package) scraping a running agent in the lab: a backend killed puts
its NatgwBackendDown alert in pending (its `for` is 5 minutes) and it resolves once the
backend is back; an invalid rule fires NatgwInvalidRules; a change the kernel refuses fires
NatgwChangeNotProgrammed and NatgwTransactionsRefused; every dashboard query returns data.

Prometheus runs in the gateway namespace, on its loopback only (127.0.0.1:19090 there,
where the agent's metrics are), scraping and evaluating every second. It loads a copy of
the shipped rules whose expressions are unchanged; only the `for` of the two alerts the
test waits to see firing (NatgwInvalidRules, 1m; NatgwChangeNotProgrammed, 2m) is 2 s in
the copy, so each case takes seconds, not minutes."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import yaml

from gwtest import (BACKENDS, DNS, EIP, ROOT, eip_doc, program, rule_doc, wait_for, write_rules, yaml_docs)
from test_backend_checks import SERVED, kill, serve
from test_dataplane import OWNER

MONITORING = ROOT / "images" / "kubernetes" / "monitoring"
PROMETHEUS = "/usr/bin/prometheus"
ADDRESS = "127.0.0.1:19090"
SHORTENED = {"NatgwInvalidRules": "2s", "NatgwChangeNotProgrammed": "2s"}

# One GET of Prometheus's HTTP API per line of stdin (path, params as JSON), its JSON per line out.
API = f"""
import json, sys, urllib.parse, urllib.request
for line in sys.stdin:
    path, params = json.loads(line)
    url = "http://{ADDRESS}" + path + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        print(urllib.request.urlopen(url, timeout=5).read().decode(), flush=True)
    except Exception as err:
        print(json.dumps({{"status": "unreachable", "error": str(err)}}), flush=True)
"""


class Prometheus:
    """A Prometheus server in the gateway namespace, asked through its HTTP API there."""

    def __init__(self, lab: Any, directory: Path) -> None:
        self.lab, self.directory = lab, directory

    def start(self) -> None:
        assert Path(PROMETHEUS).exists(), "prometheus not installed (Debian's prometheus package: make deps)"
        groups = yaml.safe_load((MONITORING / "rules.yaml").read_text())
        for rule in (r for g in groups["groups"] for r in g["rules"]):
            if rule.get("alert") in SHORTENED:
                rule["for"] = SHORTENED[rule["alert"]]
        (self.directory / "rules.yaml").write_text(yaml.safe_dump(groups))
        (self.directory / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(self.directory / "rules.yaml")],
            "scrape_configs": [{"job_name": "natgw-agent", "static_configs": [{"targets": ["127.0.0.1:10299"]}]}]}))
        self.log = open(self.directory / "prometheus.log", "wb")
        self.proc = self.lab.popen_in(self.lab.gw_ns, [
            PROMETHEUS, f"--config.file={self.directory / 'prometheus.yml'}", f"--web.listen-address={ADDRESS}",
            f"--storage.tsdb.path={self.directory / 'data'}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT)
        # Answering, and two scrapes of the agent in (what comes next changes counters).
        wait_for(lambda: self.proc.poll() is not None or self.get("/api/v1/query", {
            "query": 'count_over_time(up{job="natgw-agent"}[1m]) >= 2'})[0].get("data", {}).get("result"),
                 30, 0.2, "Prometheus to scrape the agent twice")
        assert self.proc.poll() is None, self.logs()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()

    def logs(self) -> str:
        return (self.directory / "prometheus.log").read_text()[-3000:]

    def get(self, *calls: Any) -> list[dict[str, Any]]:
        """GETs as (path, params) pairs, in one process in the namespace."""
        pairs = [calls[i:i + 2] for i in range(0, len(calls), 2)]
        out = self.lab.run_in(self.lab.gw_ns, [sys.executable, "-c", API], input="".join(
            json.dumps(list(p)) + "\n" for p in pairs), capture_output=True, text=True, timeout=60, check=True).stdout
        return [json.loads(line) for line in out.splitlines()]

    def alerts(self, name: str) -> list[dict[str, Any]]:
        """The alerts of that name now pending or firing."""
        (answer,) = self.get("/api/v1/alerts", {})
        return [a for a in answer["data"]["alerts"] if a["labels"]["alertname"] == name]

    def wait_alert(self, name: str, states: set[str], timeout: float, **labels: str) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((a for a in self.alerts(name) if a["state"] in states
                         and labels.items() <= a["labels"].items()), None)
        return wait_for(found, timeout, 0.5, f"{name} {labels} in {states}")

    def wait_gone(self, name: str, timeout: float, **labels: str) -> None:
        wait_for(lambda: not [a for a in self.alerts(name) if labels.items() <= a["labels"].items()], timeout, 0.5,
                 f"{name} {labels} to resolve")


@contextlib.contextmanager
def prometheus(lab: Any, directory: Path) -> Iterator[Prometheus]:
    server = Prometheus(lab, directory)
    try:
        server.start()
        yield server
    finally:
        if hasattr(server, "proc"):
            server.stop()
            sys.stderr.write(server.logs())
        shutil.rmtree(directory / "data", ignore_errors=True)


def test_backend_down_and_invalid_rule_alerts_and_every_dashboard_query_on_real_output(lab, agent, tmp_path):
    servers = {n: serve(lab, n) for n in BACKENDS}
    rules = [rule_doc(f"web-{n}", 80, ip, SERVED) for n, ip in BACKENDS.items()]
    program(agent, *rules, identities=1)
    with prometheus(lab, tmp_path) as prom:
        assert lab.tcp_connect(EIP, 80, 30)["failed"] == 0
        assert not [a for a in prom.get("/api/v1/alerts", {})[0]["data"]["alerts"]
                    if a["labels"]["alertname"] != "NatgwAgentDown"], "alerts on a healthy agent"

        # b2's server dies: its checks take it down, its alert pends (for: 5m, as shipped).
        kill(servers["b2"])
        down = prom.wait_alert("NatgwBackendDown", {"pending", "firing"}, 30, backend=f"{BACKENDS['b2']}:{SERVED}")
        assert down["labels"]["check"].startswith("tcp") and down["labels"]["severity"] == "warning", down

        # A rule with an invalid port is left out: its alert fires.
        bad = rule_doc("web-bad", 80, "10.0.1.14", 70000)
        write_rules(agent.rules_dir, "rules.yaml", yaml_docs(eip_doc(), *rules, bad))
        invalid = prom.wait_alert("NatgwInvalidRules", {"firing"}, 30)
        assert invalid["labels"]["field"] == "spec.internalPort" and "kubectl get events" in invalid["annotations"][
            "description"], invalid
        assert lab.tcp_connect(EIP, 80, 30)["failed"] == 0

        # Every dashboard query, on this output: each parses and returns data (a few scrapes
        # after the traffic, so rates over [5m] have two counter readings).
        dash = json.loads((MONITORING / "dashboard.json").read_text())
        queries = [(p["title"], t["expr"].replace("$instance", ".*")) for p in dash["panels"] for t in p["targets"]]

        def missing() -> list[tuple[str, Any]]:
            """The queries with no series or only NaN ones (a quantile of no observation in
            [5m]: a kind of sync that did not happen then)."""
            answers = prom.get(*[x for _, q in queries for x in ("/api/v1/query", {"query": q})])
            return [(t, a) for (t, _), a in zip(queries, answers) if a["status"] != "success"
                    or all(r["value"][1] == "NaN" for r in a["data"]["result"])]
        try:
            wait_for(lambda: not missing(), 40, 1.0, "every dashboard query to return data")
        except AssertionError:
            raise AssertionError(missing())

        # b2 is back: its alert resolves; the rule fixed: so does that one.
        servers["b2"] = serve(lab, "b2")
        prom.wait_gone("NatgwBackendDown", 30)
        write_rules(agent.rules_dir, "rules.yaml", yaml_docs(eip_doc(), *rules))
        prom.wait_gone("NatgwInvalidRules", 30)
    for proc in servers.values():
        kill(proc)


def test_a_change_the_kernel_refuses_fires_its_alerts(lab, agent, tmp_path):
    """As test_dataplane's refused transaction: another process owns a table of the agent's
    name (`flags owner`), so the kernel refuses every transaction of a restarted agent."""
    program(agent, *DNS, identities=1)
    with prometheus(lab, tmp_path) as prom:
        assert agent.stop() == 0
        agent.nft("delete", "table", "ip", "natgw")
        holder = lab.popen_in(lab.gw_ns, [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            agent.start()
            stuck = prom.wait_alert("NatgwChangeNotProgrammed", {"firing"}, 40)
            assert stuck["labels"]["severity"] == "critical" and "ApplyFailed" in stuck["annotations"]["description"]
            refused = prom.wait_alert("NatgwTransactionsRefused", {"firing"}, 20)
            assert "natgw-agent diff" in refused["annotations"]["description"], refused
        finally:
            holder.stdin.close()  # the owner goes, and its table with it
            holder.wait(5)
        wait_for(lambda: agent.services().get((EIP, "udp", 53)) == "lb_n3", 20, what="convergence after retry")
        prom.wait_gone("NatgwChangeNotProgrammed", 30)
