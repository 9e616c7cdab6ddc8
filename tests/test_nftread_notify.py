"""Change notifications decoded with the dump decoders (tests/nftnotify.py over
agent/kernel/nftobjects.py and agent/kernel/nftrule.py), on recorded notifications: who
committed, what changed, and nothing raises on garbled input."""
from __future__ import annotations

import random
from typing import Any

import pytest

from agent.kernel import nftuapi as uapi
from tests.netlinkfx import FIXTURES, decoded, load, messages
from tests.nftnotify import Decoder


@pytest.fixture(params=FIXTURES, ids=[p.stem for p in FIXTURES], scope="module")
def fixture(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load(request.param)

def test_notifications_name_the_committing_socket(fixture: dict[str, Any]) -> None:
    """Commits through the nftables binding carry one of this process's NETLINK_NETFILTER
    port ids; a commit by `nft` in a subprocess carries another (its own)."""
    notes = fixture["notifications"]
    dec = Decoder()
    for commit in notes["binding"]:
        changes = [dec.decode(m) for m in messages(commit["messages"])]
        assert changes and all(c.portid in commit["own_portids"] for c in changes), commit["commands"]
        (gen,) = [c for c in changes if c.kind == "gen"]
        assert gen.obj["pid"] == notes["pid"] and gen is changes[-1]
    for commit in notes["nft"]:
        changes = [dec.decode(m) for m in messages(commit["messages"])]
        assert changes and all(c.portid not in commit["own_portids"] for c in changes), commit["commands"]
        (gen,) = [c for c in changes if c.kind == "gen"]
        assert gen.obj["comm"] == "nft" and gen.obj["pid"] == commit["nft_pid"]


def test_notifications_decode_with_the_dump_decoders(fixture: dict[str, Any]) -> None:
    state = decoded(fixture, "ip natgw")
    dec = Decoder(state)
    add, chain_and_rule, delete = (messages(c["messages"]) for c in fixture["notifications"]["binding"])
    (elem,) = [dec.decode(m) for m in add if m.msg == uapi.NFT_MSG_NEWSETELEM]
    assert (elem.kind, elem.op, elem.family, elem.table, elem.name) == ("element", "new", "ip", "natgw", "services")
    (e,) = elem.obj
    assert (e.key, e.value, e.comment) == (("172.18.0.99", "tcp", 99), {"goto": {"target": "lb_n3"}}, "probe")
    changes = [dec.decode(m) for m in chain_and_rule]
    assert [(c.kind, c.op) for c in changes] == [("chain", "new"), ("set", "new"), ("element", "new"),
                                                 ("element", "new"), ("rule", "new"), ("gen", "new")]
    (rule,) = [c for c in changes if c.kind == "rule"]
    assert rule.name == "probe_chain" and rule.obj == {"expr": [{"vmap": {
        "key": {"numgen": {"mode": "random", "mod": 2, "offset": 0}},
        "data": {"set": [[0, {"goto": {"target": "slot_0"}}], [1, {"goto": {"target": "slot_1"}}]]}}}]}
    assert changes[0].obj == {} and changes[0].name == "probe_chain"
    gone = [(c.kind, c.op, c.name) for c in (dec.decode(m) for m in delete)]
    assert ("element", "del", "services") in gone and ("chain", "del", "probe_chain") in gone


def test_an_unknown_sets_elements_are_named_not_decoded(fixture: dict[str, Any]) -> None:
    dec = Decoder()
    (commit,) = [c for c in fixture["notifications"]["nft"] if "element" in c["commands"]]
    (elem,) = [dec.decode(m) for m in messages(commit["messages"]) if m.msg == uapi.NFT_MSG_NEWSETELEM]
    assert (elem.table, elem.name, elem.obj) == ("other", "s", None)


def test_garbled_notifications_decode_without_raising(fixture: dict[str, Any]) -> None:
    rng = random.Random(11)
    msgs = [m for c in fixture["notifications"]["binding"] + fixture["notifications"]["nft"]
            for m in messages(c["messages"])]
    dec = Decoder(decoded(fixture, "ip natgw"))
    for _ in range(2000):
        m = rng.choice(msgs)
        buf = bytearray(m.buf)
        i = rng.randrange(m.start, m.end)
        buf[i] = rng.randrange(256)
        dec.decode(m._replace(buf=bytes(buf), end=rng.randrange(m.start, m.end + 1)))
