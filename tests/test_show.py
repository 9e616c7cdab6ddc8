"""`show`'s agent block: what keeps the running agent from serving, as its status socket
says it (no kernel: the table part is checked in the netns tests)."""
from __future__ import annotations

from pathlib import Path

from agent.kernel.caps import Capabilities
from agent.ops.status import agent_status
from agent.sources.crd import CRD_NAME
from agent.run.crdcheck import CrdCheck
from agent.ops.health import Health
from agent.ops.show import format_show
from agent.ops.status import StatusServer


class Unreachable(Exception):
    pass


def shown(tmp_path: Path, health: Health) -> str:
    """`show`'s text for a running agent with this health (and no table yet)."""
    server = StatusServer(tmp_path / "agent.sock", health.answer(Capabilities(nft_version="1.1.3")))
    try:
        return format_show(None, False, agent_status(server.path))
    finally:
        server.close()


def failing() -> None:
    raise Unreachable("connect timeout")


def test_show_says_the_crd_is_not_checked_yet_and_why(tmp_path: Path) -> None:
    health = Health(60, 30)
    health.synced()
    CrdCheck(failing, health, None, "gw1").check_once()
    text = shown(tmp_path, health)
    assert text.startswith("agent: NOT READY; nftables 1.1.3")
    assert f"  problem: CRD not checked yet ({CRD_NAME}: Unreachable: connect timeout)\n" in text


def test_show_names_what_the_crd_lacks_and_nothing_once_it_is_fine(tmp_path: Path) -> None:
    health = Health(60, 30)
    health.synced()
    schema: dict = {"type": "object", "properties": {"spec": {"type": "object", "properties": {"eip": {}}}}}
    crd = {"spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": schema}}]}}
    check = CrdCheck(lambda: crd, health, None, "gw1")
    check.check_once()
    text = shown(tmp_path, health)
    assert "agent: NOT READY" in text and f"  problem: CRD {CRD_NAME} has no spec.type:" in text
    schema["properties"]["spec"]["properties"].update(type={}, sessionAffinity={}, sessionAffinityTimeoutSeconds={})
    check.check_once()
    text = shown(tmp_path, health)
    assert text.startswith("agent: ready;") and "problem" not in text
