"""What operators deploy to watch the agent (images/kubernetes/monitoring/): the rules are
valid (`promtool check rules`), each alert fires on a series that should fire it and
stays silent on one that should not (`promtool test rules`), the PrometheusRule says the
same as the plain rules file, every alert carries a severity, a summary, a description and
a runbook that exists in docs/alerts.md, every dashboard query parses, and every metric the
rules and the dashboard read is one the agent exports. (netns-tests/test_monitoring_prometheus.py
runs them against a real Prometheus scraping a running agent.)"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from agent.ops.metrics import Metrics, _BackendCounters

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "images" / "kubernetes" / "monitoring"
RULES = MONITORING / "rules.yaml"
RULES_TEST = ROOT / "tests" / "fixtures" / "monitoring" / "rules_test.yaml"
ALERTS_DOC = ROOT / "docs" / "alerts.md"
JOB = 'job="natgw-agent"'


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    # Debian's prometheus package (make deps installs it): a missing one fails, never skips.
    assert shutil.which("promtool"), "promtool not installed (Debian's prometheus package: make deps)"
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def alerts() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, the $instance variable at its All value."""
    dash = json.loads((MONITORING / "dashboard.json").read_text())
    return [(p["title"], t["expr"].replace("$instance", ".*")) for p in dash["panels"] for t in p["targets"]]


def test_the_rules_are_valid() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0 and f"SUCCESS: {len(alerts())} rules found" in done.stdout, done.stdout + done.stderr


def test_each_alert_fires_and_stays_silent_where_it_should() -> None:
    done = promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    cases = yaml.safe_load(RULES_TEST.read_text())
    assert cases["rule_files"] == [str(Path("../../../images/kubernetes/monitoring/rules.yaml"))]
    firing: set[str] = set()
    silent: set[str] = set()
    for test in cases["tests"]:
        for check in test["alert_rule_test"]:
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert firing == names and silent == names, (names - firing, names - silent)


def test_every_alert_says_how_bad_what_and_where_to_look() -> None:
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", ALERTS_DOC.read_text(), re.M)}
    for alert in alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("warning", "critical"), name
        notes = alert["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url"}, name
        assert re.search(r"natgw-agent (show|diff|health)|reason=|Event", notes["description"]), name
        assert notes["runbook_url"] == f"docs/alerts.md#{name.lower()}" and name.lower() in anchors, name
        # Every selector is the agent's job's (the README says how to name it).
        assert re.findall(r"\w+\{[^}]*\}", alert["expr"]) and all(
            JOB in s for s in re.findall(r"\w+\{[^}]*\}", alert["expr"])), name


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation out, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_prometheusrule_is_the_rules_file() -> None:
    sys.path.insert(0, str(MONITORING))
    sys.dont_write_bytecode, before = True, sys.dont_write_bytecode  # no __pycache__ among the manifests
    try:
        from make_prometheusrule import render
    finally:
        sys.path.remove(str(MONITORING))
        sys.dont_write_bytecode = before
    shipped = (MONITORING / "prometheusrule.yaml").read_text()
    assert shipped == render(RULES.read_text()), "run images/kubernetes/monitoring/make_prometheusrule.py"
    doc = yaml.safe_load(shipped)
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert doc["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """Each target as a recording rule: promtool parses it as Prometheus would."""
    queries = dashboard_queries()
    assert len(queries) >= 14
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query{n}", "expr": e}
                                                          for n, (_, e) in enumerate(queries)]}]}
    (tmp_path / "dashboard-rules.yaml").write_text(yaml.safe_dump(rules))
    done = promtool("check", "rules", str(tmp_path / "dashboard-rules.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr


def exported() -> set[str]:
    """The sample names the agent's /metrics can carry, from its registry (every family,
    labelled or not) and the per-backend counters' collector."""
    registry = Metrics().registry
    backends = CollectorRegistry()
    backends.register(_BackendCounters(lambda: {}))
    names = {"up"}  # Prometheus's own, per target
    for family in [*registry.collect(), *backends.collect()]:
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}[family.type]
        names |= {family.name + s for s in suffixes}
    return names


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values and count_values' label are not names
    return set(re.findall(r"\b(up|natgw_\w+|process_\w+)\b(?=\s*[{\[)]|\s|$)", expr))


def test_every_metric_read_is_one_the_agent_exports() -> None:
    have = exported()
    used = {n for a in alerts() for n in metric_names(a["expr"])} | {n for _, e in dashboard_queries()
                                                                    for n in metric_names(e)}
    assert {"natgw_backend_packets_total", "natgw_table_digest", "process_resident_memory_bytes"} <= used
    assert used <= have, used - have
