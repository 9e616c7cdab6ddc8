"""`show`'s agent block: what keeps the running agent from serving, as its status socket
says it; and where a client goes (`show --client`), on a rendered table (no kernel: the
table read back is checked in the netns tests)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.kernel.caps import Capabilities
from agent.ops.status import agent_status
from agent.sources.crd import CRD_NAME
from agent.run.crdcheck import CrdCheck
from agent.ops.health import Health
from agent.core.consistent import bucket, choose
from agent.core.desired import Service
from agent.core.layout import identity_key, sticky_chain
from agent.core.model import Backend, Identity
from agent.core.render import buckets
from agent.core.ruleset import Buckets, goto
from agent.ops.show import _client_line, format_show, reach
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


# --- where a client goes (show --client): the pure half, on a rendered table ------------

APP = Identity("172.18.0.10", 443, "tcp")
BACKENDS = [Backend("10.0.1.11", 9090), Backend("10.0.1.12", 9090), Backend("10.0.1.13", 9090)]


def clientip_table() -> tuple[dict[Backend, int], Any]:
    """One ClientIP identity rendered with its backends in slots that are not their order
    (a replica's history), and its chash element."""
    held = {BACKENDS[0]: 2, BACKENDS[1]: 0, BACKENDS[2]: 5}
    service = Service(APP, tuple(BACKENDS), True, 600, ("app",))
    return held, buckets(service.backends, held, 600)


def test_an_unpinned_client_goes_where_its_bucket_says_which_is_the_consistent_choice() -> None:
    held, table = clientip_table()
    clients = [f"198.51.100.{i}" for i in range(1, 60)]
    answers = [reach(c, APP, True, held, table, {}) for c in clients]
    assert {a["backend"] for a in answers} == {str(b) for b in BACKENDS}  # every backend: the check can fail
    for client, a in zip(clients, answers):
        assert a["backend"] == a["expected"] == str(choose(BACKENDS, client)) and not a["pinned"], a
        assert a["how"] == f"bucket {bucket(client)} of the consistent table"


def test_a_pinned_client_goes_to_its_pin_and_an_out_of_step_table_is_named() -> None:
    held, table = clientip_table()
    client = "198.51.100.7"
    chosen = choose(BACKENDS, client)
    other = next(b for b in BACKENDS if b != chosen)
    entries = {f"aff_{held[other]}": [((client, *identity_key(APP)), 412_000)]}
    pinned = reach(client, APP, True, held, table, entries)
    assert pinned == {"address": client, "backend": str(other), "pinned": True, "expires_s": 412,
                      "how": f"pinned to slot {held[other]}"}
    assert f"client {client}: {other} (pinned to slot {held[other]}, 412 s left)" in _client_line(pinned)
    # a table whose bucket names another slot than the model's: said so
    stale = Buckets(goto(sticky_chain(held[other], 600)) for _ in range(len(table)))
    answer = reach(client, APP, True, held, stale, {})
    assert answer["backend"] == str(other) and answer["expected"] == str(chosen)
    assert f"OUT OF STEP: every replica's table says {chosen}" in _client_line(answer)
    missing = reach(client, APP, True, held, None, {})
    assert missing["backend"] is None and "not in the kernel" in missing["how"]
    assert reach(client, APP, False, held, None, {})["how"].startswith("random per connection")
