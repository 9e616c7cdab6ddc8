"""Write prometheusrule.yaml (prometheus-operator's PrometheusRule) from rules.yaml, the
one source of the alerts: `python3 images/kubernetes/monitoring/make_prometheusrule.py`.
tests/test_monitoring.py fails when the two differ."""
from __future__ import annotations

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
HEADER = """\
# natgw-agent's alerts for prometheus-operator: WRITTEN by make_prometheusrule.py from
# rules.yaml (edit that, then run it). Add the labels your Prometheus's ruleSelector
# selects (kube-prometheus-stack: release: <its release name>) and apply it in a
# namespace its ruleNamespaceSelector covers. Runbooks: docs/alerts.md.
"""


def render(rules: str) -> str:
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": "natgw-agent", "namespace": "kube-system",
                        "labels": {"app.kubernetes.io/name": "natgw-agent"}},
           "spec": {"groups": yaml.safe_load(rules)["groups"]}}
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=100)


if __name__ == "__main__":
    (HERE / "prometheusrule.yaml").write_text(render((HERE / "rules.yaml").read_text()))
