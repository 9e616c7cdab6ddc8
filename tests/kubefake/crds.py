"""The IptablesDnatRule CRD the fake serves from the start, as a cluster with kube-ovn has
one: a kube-ovn with share DNAT (#6858) and its affinity fields (#7047), the cluster the
agent works with. Tests give an older schema with FakeKube.set_crd(dnat_rule_crd(fields)),
or delete it. Written here, not taken from the agent: the fake shares no code with it."""
from __future__ import annotations

from .protocol import JSON

CRD_NAME = "iptables-dnat-rules.kubeovn.io"
BASE_FIELDS = ["eip", "externalPort", "protocol", "internalIp", "internalPort"]  # kube-ovn v1.14's
SHARE_FIELDS = [*BASE_FIELDS, "type", "sessionAffinity", "sessionAffinityTimeoutSeconds"]


def dnat_rule_crd(fields: list[str] = SHARE_FIELDS) -> JSON:
    """The CRD with these spec fields (strings, as kube-ovn declares them)."""
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": CRD_NAME},
            "spec": {"group": "kubeovn.io", "scope": "Cluster",
                     "names": {"plural": "iptables-dnat-rules", "singular": "iptables-dnat-rule",
                               "kind": "IptablesDnatRule", "shortNames": ["dnat"]},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "properties": {"spec": {"type": "object", "properties": {
                             f: {"type": "string"} for f in fields}}}}}}]}}
