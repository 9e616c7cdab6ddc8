"""Builders for the objects the agent reads, as the Kubernetes API returns them."""
from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def eip(name: str, address: str, gateway: str = "gw1") -> dict[str, Any]:
    return {"apiVersion": "kubeovn.io/v1", "kind": "IptablesEIP", "metadata": {"name": name},
            "spec": {"v4ip": address, "natGwDp": gateway}, "status": {"ready": True, "ip": address}}


def rule(name: str, port: int | str, backend: str, backend_port: int | str = 8080, *, proto: str = "tcp",
         eip_name: str = "eip-web", affinity: str = "", timeout: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"eip": eip_name, "externalPort": str(port), "protocol": proto, "internalIp": backend,
                            "internalPort": str(backend_port), "type": "share"}
    if affinity:
        spec["sessionAffinity"] = affinity
    if timeout is not None:
        spec["sessionAffinityTimeoutSeconds"] = timeout
    return {"apiVersion": "kubeovn.io/v1", "kind": "IptablesDnatRule", "metadata": {"name": name}, "spec": spec}


def web_objects() -> list[dict[str, Any]]:
    """Three identities on one EIP: stateless TCP (3 backends), ClientIP (2), UDP (1)."""
    return [eip("eip-web", "172.18.0.10"),
            rule("web-a", 80, "10.0.1.11"), rule("web-b", 80, "10.0.1.12"), rule("web-c", 80, "10.0.1.13"),
            rule("app-a", 443, "10.0.1.11", 9090, affinity="ClientIP", timeout=600),
            rule("app-b", 443, "10.0.1.12", 9090, affinity="ClientIP", timeout=600),
            rule("dns-a", 53, "10.0.1.12", 5353, proto="UDP")]


def rendered(objects: list[Any], previous: Any = None) -> Any:
    """The whole table the agent renders for these objects (gateway gw1, default settings);
    slots follow `previous` (a Ruleset)."""
    from tests.oracles import build_inventory, desired_services
    from tests.oracles import render
    from agent.core.ruleset import EMPTY
    from agent.settings import Settings

    settings = Settings()
    services = desired_services(build_inventory(objects, "gw1").rules, settings.max_backends).services
    return render(services, previous or EMPTY, settings.affinity_set_size, settings.priority)
