"""Refusing loudly a cluster that cannot work: the API server prunes fields its CRD schema
lacks, so on a kube-ovn release without share DNAT (before master after v1.16.2, #6858)
or its affinity fields (#7047) every rule reaches the agent as an exclusive one and the
agent would silently serve nothing. The IptablesDnatRule CRD is read at start (least
privilege: get on that one name) and its schema checked."""
from __future__ import annotations

from typing import Any

CRD_NAME = "iptables-dnat-rules.kubeovn.io"
VERSION = "v1"
# spec field -> what brings it
NEEDED = {
    "type": "share DNAT (kube-ovn #6858: master after v1.16.2 / v1.15.24)",
    "sessionAffinity": "session affinity (kube-ovn #7047)",
    "sessionAffinityTimeoutSeconds": "session affinity (kube-ovn #7047)",
}


def problems(crd: dict[str, Any]) -> list[str]:
    """What the CRD's schema lacks for the agent to work, each naming the field and the
    kube-ovn change it needs; [] when everything is there (or nothing is pruned)."""
    versions = (crd.get("spec") or {}).get("versions") or []
    version = next((v for v in versions if v.get("name") == VERSION), None)
    if version is None:
        return [f"CRD {CRD_NAME} serves no version {VERSION}"]
    schema = ((version.get("schema") or {}).get("openAPIV3Schema") or {})
    spec = (schema.get("properties") or {}).get("spec") or {}
    if schema.get("x-kubernetes-preserve-unknown-fields") or spec.get("x-kubernetes-preserve-unknown-fields"):
        return []  # nothing is pruned
    present = set((spec.get("properties") or {}))
    return [f"CRD {CRD_NAME} has no spec.{name}: the API server drops it from every rule; needs {why}"
            for name, why in NEEDED.items() if name not in present]
