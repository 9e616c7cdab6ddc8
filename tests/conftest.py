"""Shared builders for unit tests (no root, no kernel)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings

from agent import log as logsetup

# CI replays the same examples on every run (they found their bugs here, with thousands
# of random runs); a developer's run keeps exploring.
hypothesis_settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")

logsetup.configure("console", "info")  # the agent's level: no per-transaction debug dumps

ROOT = Path(__file__).resolve().parent.parent
UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"


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


def check_golden(path: Path, actual: str) -> None:
    """Compare with a golden file; UPDATE_GOLDEN=1 rewrites it when a change is intended."""
    if UPDATE_GOLDEN:
        path.write_text(actual)
    assert path.exists(), f"golden file {path} missing: run with UPDATE_GOLDEN=1"
    assert actual == path.read_text(), f"{path.name} differs from the golden file (UPDATE_GOLDEN=1 to accept)"


@pytest.fixture
def web_objects() -> list[dict[str, Any]]:
    return [eip("eip-web", "172.18.0.10"),
            rule("web-a", 80, "10.0.1.11"), rule("web-b", 80, "10.0.1.12"), rule("web-c", 80, "10.0.1.13"),
            rule("app-a", 443, "10.0.1.11", 9090, affinity="ClientIP", timeout=600),
            rule("app-b", 443, "10.0.1.12", 9090, affinity="ClientIP", timeout=600),
            rule("dns-a", 53, "10.0.1.12", 5353, proto="UDP")]
