"""The fake holds a table as the kernel does: every case of tests/fakenft_cases.py gives
the kernel's answer (netns-tests/test_fakenft_kernel.py runs the same cases against the
kernel), a refused transaction leaves nothing behind, and trace() follows the agent's
rules to a backend."""
from __future__ import annotations

import pytest

from agent.core.layout import identity_key
from agent.core.consistent import choose
from agent.core.model import Backend, Identity
from agent.kernel.nft import Nft
from agent.core.plan import plan
from tests.builders import rendered, web_objects
from tests.fakenft import FakeNft
from tests.fakenft_cases import CASES, OK, SETUP


@pytest.mark.parametrize("case", list(CASES))
def test_each_case_gets_the_kernels_answer(case: str) -> None:
    fake = FakeNft()
    assert fake.json_cmd({"nftables": SETUP})[0] == 0
    before, generation = fake.dump("ip", "t"), fake.generation()
    commands, expected = CASES[case]
    rc, _, err = fake.json_cmd({"nftables": commands})
    if expected == OK:
        assert (rc, err) == (0, "") and fake.generation() == generation + 1
    else:
        assert rc == 1 and any(e in err for e in (expected if isinstance(expected, tuple) else (expected,))), err
        assert fake.dump("ip", "t") == before and fake.generation() == generation  # all or nothing


def test_listings_do_not_move_the_generation_and_missing_tables_are_enoent() -> None:
    fake = FakeNft()
    rc, _, err = fake.json_cmd({"nftables": [{"list": {"table": {"family": "ip", "name": "natgw"}}}]})
    assert rc == 1 and "No such file or directory" in err and fake.generation() == 0


def test_fail_next_refuses_and_changes_nothing() -> None:
    fake = FakeNft()
    fake.fail_next(2, "Error: injected")
    assert fake.json_cmd({"nftables": SETUP}) == (1, "", "Error: injected")
    assert fake.cmd("add table ip t") == (1, "", "Error: injected")
    assert fake.tables == {} and fake.generation() == 0
    assert fake.json_cmd({"nftables": SETUP})[0] == 0 and fake.generation() == 1


def test_trace_follows_the_rendered_table_to_each_backend_and_pins_clientip() -> None:
    fake = FakeNft()
    nft = Nft("ip", "natgw", fake)
    nft.apply(plan(None, rendered(web_objects()), "ip", "natgw"))
    web = [fake.trace("198.51.100.7", "172.18.0.10", "tcp", 80, pick=lambda mod, i=i: i) for i in range(3)]
    assert web == [("10.0.1.11", 8080), ("10.0.1.12", 8080), ("10.0.1.13", 8080)]
    assert fake.trace("198.51.100.7", "172.18.0.10", "tcp", 81) is None  # no identity: not NATed
    assert fake.trace("198.51.100.7", "172.18.0.10", "udp", 53) == ("10.0.1.12", 5353)
    # ClientIP: a new client's backend is the consistent choice (numgen is not consulted),
    # then its pin keeps it there.
    app = [Backend("10.0.1.11", 9090), Backend("10.0.1.12", 9090)]
    clients = [f"198.51.100.{i}" for i in range(8, 40)]
    expected = {c: choose(app, c) for c in clients}
    assert len(set(expected.values())) == 2  # the clients reach every backend: the check below can fail
    for i, client in enumerate(clients):
        first = fake.trace(client, "172.18.0.10", "tcp", 443, pick=lambda mod, i=i: i % mod)
        assert first == (expected[client].ip, expected[client].port), client
    chosen = choose(app, "198.51.100.8")
    slot = app.index(chosen)  # the backends hold slots 0 and 1 in order
    assert ("198.51.100.8", *identity_key(Identity("172.18.0.10", 443, "tcp"))) in fake.entries("natgw", f"aff_{slot}")
    for name, held in fake.tables[("ip", "natgw")].sets.items():  # the buckets gone: only the pin keeps it
        if name.startswith("chash_"):
            held.elems.clear()
    again = fake.trace("198.51.100.8", "172.18.0.10", "tcp", 443, pick=lambda mod: (slot + 1) % mod)
    assert again == (chosen.ip, chosen.port)  # pinned
    other = fake.trace("198.51.100.200", "172.18.0.10", "tcp", 443, pick=lambda mod: (slot + 1) % mod)
    assert other == (app[(slot + 1) % 2].ip, app[(slot + 1) % 2].port)  # no buckets: numgen, the fallback
