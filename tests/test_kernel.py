"""The kernel view's pure parts: which notifications are damage (on recorded notifications
of commits through the binding and by `nft`, for both nftables versions), which come
after a read, and how damaged objects are read again."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.kernel import nfnetlink as nl
from agent.kernel import nftuapi as uapi
from agent.kernel.nftread import commits_after
from agent.kernel.view import NONE, Damage, damage_of, reread
from agent.core.ruleset import Elem, Ruleset
from tests.builders import rendered, web_objects
from tests.nlmsg import nft_type

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "netlink").glob("nft-*.json"))


@pytest.fixture(params=FIXTURES, ids=[p.stem for p in FIXTURES])
def notes(request: pytest.FixtureRequest) -> dict[str, Any]:
    return json.loads(request.param.read_text())["notifications"]


def messages(commits: list[dict[str, Any]]) -> list[nl.Message]:
    return [m for c in commits for h in c["messages"] for m in nl.split_messages(bytes.fromhex(h))]


def test_the_agents_own_commits_are_no_damage(notes: dict[str, Any]) -> None:
    own = set(notes["binding"][0]["own_portids"])
    found, unknown = damage_of(messages(notes["binding"]), "ip", "natgw", own)
    assert found == NONE and not found and unknown == set()


def test_someone_elses_commits_to_the_agents_table_are(notes: dict[str, Any]) -> None:
    found, unknown = damage_of(messages(notes["binding"]), "ip", "natgw", own=set())
    assert found.ours() and not found.everything
    assert found.chains == {"probe_chain"} and found.elements == {"services"}
    assert unknown == set(notes["binding"][0]["own_portids"]) & unknown and unknown  # whose, to check


def test_another_tables_commits_are_nothing_unless_watched(notes: dict[str, Any]) -> None:
    others = messages(notes["nft"])  # add table other, a set, an element; delete the table
    assert damage_of(others, "ip", "natgw", own=set()) == (NONE, set())
    found, _ = damage_of(others, "ip", "natgw", own=set(), also=("other",))
    assert found.others == {"other"} and not found.ours()


def test_lost_notifications_or_a_table_change_mean_everything(notes: dict[str, Any]) -> None:
    assert damage_of([], "ip", "natgw", set(), overrun=True)[0].everything
    recreated = [m for m in messages(notes["nft"]) if m.msg in (uapi.NFT_MSG_NEWTABLE, uapi.NFT_MSG_DELTABLE)]
    assert damage_of(recreated, "ip", "other", set())[0].everything


def test_affinity_entries_are_not_damage() -> None:
    def note(msg: int, table: str, set_name: str) -> nl.Message:
        raw = nl.build_message(nft_type(msg), 0, 0, 2, nl.attr_str(uapi.NFTA_SET_ELEM_LIST_TABLE, table)
                               + nl.attr_str(uapi.NFTA_SET_ELEM_LIST_SET, set_name))
        (m,) = nl.split_messages(raw)
        return m

    found, _ = damage_of([note(uapi.NFT_MSG_DELSETELEM, "natgw", "aff_0"), note(uapi.NFT_MSG_DELSETELEM, "natgw", "backend_0")],
                         "ip", "natgw", set())
    assert found.elements == {"backend_0"}


def test_after_keeps_only_commits_past_the_read(notes: dict[str, Any]) -> None:
    commits = notes["binding"]
    msgs = messages(commits)
    gens = [nl.get_be32(m.attrs()[uapi.NFTA_GEN_ID]) for m in msgs if m.msg == uapi.NFT_MSG_NEWGEN]
    assert len(gens) == len(commits)
    assert commits_after(msgs, gens[-1]) == []
    kept = commits_after(msgs, gens[0])  # the first commit was read; the later ones were not
    assert kept == [m for m in messages(commits[1:]) if m.msg != uapi.NFT_MSG_NEWGEN]


def test_reread_replaces_only_what_was_damaged() -> None:
    mirror = rendered(web_objects())
    kernel_head = Ruleset(mirror.sets, mirror.chains, {**mirror.rules, "slot_0": ()}, {})
    services = {k: e for k, e in mirror.elements["services"].items() if k[2] != 80}
    asked: list[str] = []

    def elements(name: str) -> dict[Any, Elem] | None:
        asked.append(name)
        return services if name == "services" else None

    current = reread(Damage(chains=frozenset({"slot_0"}), elements=frozenset({"services"})), mirror,
                     lambda: kernel_head, elements)
    assert current.rules["slot_0"] == () and current.rules["lb_n3"] == mirror.rules["lb_n3"]
    assert current.elements["services"] == services and asked == ["services"]
    assert current.elements["backend_0"] is mirror.elements["backend_0"]  # not read again, not copied
    assert reread(Damage(chains=frozenset({"x"})), mirror, lambda: None, elements) == Ruleset()  # the table went
