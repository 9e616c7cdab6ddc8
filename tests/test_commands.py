"""The command constructors (agent/core/commands.py): each one's exact JSON, keys in the
order libnftables and the golden files see them, and the names each verb refuses."""
from __future__ import annotations

import json
from typing import Any

import pytest

from agent.core.commands import IDENTIFIER, NAME, CommandError, Table, set_kind
from agent.core.layout import BACKEND_DATA, IDENTITY_TYPE, affinity_set, backend_map, pattern_chain, sticky_chain

T = Table("ip", "natgw")
MAP = {"type": IDENTITY_TYPE, "map": BACKEND_DATA}
SET = {"type": ["ipv4_addr"], "flags": ["dynamic", "timeout"], "size": 65535}
RULE = {"expr": [{"accept": None}], "comment": "web"}


def exact(command: dict[str, Any]) -> str:
    """The command as libnftables receives it: key order matters (digests, golden files)."""
    return json.dumps(command)


@pytest.mark.parametrize("command, expected", [
    (T.add(), {"add": {"table": {"family": "ip", "name": "natgw"}}}),
    (T.delete(), {"delete": {"table": {"family": "ip", "name": "natgw"}}}),
    (T.flush(), {"flush": {"table": {"family": "ip", "name": "natgw"}}}),
    (T.destroy(), {"destroy": {"table": {"family": "ip", "name": "natgw"}}}),
    (T.add_chain("prerouting", {"type": "nat", "hook": "prerouting", "prio": -160, "policy": "accept"}),
     {"add": {"chain": {"family": "ip", "table": "natgw", "name": "prerouting", "type": "nat", "hook": "prerouting",
                        "prio": -160, "policy": "accept"}}}),
    (T.add_chain("slot_0", {}), {"add": {"chain": {"family": "ip", "table": "natgw", "name": "slot_0"}}}),
    (T.flush_chain("slot_0"), {"flush": {"chain": {"family": "ip", "table": "natgw", "name": "slot_0"}}}),
    (T.delete_chain("slot_0"), {"delete": {"chain": {"family": "ip", "table": "natgw", "name": "slot_0"}}}),
    (T.add_set("backend_0", MAP),
     {"add": {"map": {"family": "ip", "table": "natgw", "name": "backend_0", "type": IDENTITY_TYPE,
                      "map": BACKEND_DATA}}}),
    (T.add_set("aff_0", SET),
     {"add": {"set": {"family": "ip", "table": "natgw", "name": "aff_0", "type": ["ipv4_addr"],
                      "flags": ["dynamic", "timeout"], "size": 65535}}}),
    (T.delete_set("backend_0", MAP), {"delete": {"map": {"family": "ip", "table": "natgw", "name": "backend_0"}}}),
    (T.delete_set("aff_0", SET), {"delete": {"set": {"family": "ip", "table": "natgw", "name": "aff_0"}}}),
    (T.add_rule("slot_0", RULE),
     {"add": {"rule": {"family": "ip", "table": "natgw", "chain": "slot_0", "expr": [{"accept": None}],
                       "comment": "web"}}}),
    (T.add_elements("services", [[{"concat": ["172.18.0.10", "tcp", 80]}, {"goto": {"target": "lb_n2"}}]]),
     {"add": {"element": {"family": "ip", "table": "natgw", "name": "services",
                          "elem": [[{"concat": ["172.18.0.10", "tcp", 80]}, {"goto": {"target": "lb_n2"}}]]}}}),
    (T.delete_elements("services", [{"concat": ["172.18.0.10", "tcp", 80]}]),
     {"delete": {"element": {"family": "ip", "table": "natgw", "name": "services",
                             "elem": [{"concat": ["172.18.0.10", "tcp", 80]}]}}}),
    (T.destroy_elements("aff_0", ["172.18.0.101"]),
     {"destroy": {"element": {"family": "ip", "table": "natgw", "name": "aff_0", "elem": ["172.18.0.101"]}}}),
])
def test_each_constructor_builds_the_command_libnftables_takes(command: dict[str, Any], expected: dict[str, Any]) -> None:
    assert exact(command) == exact(expected)


def test_the_kind_of_a_declaration_is_decided_by_its_data() -> None:
    assert (set_kind(MAP), set_kind(SET), set_kind({})) == ("map", "set", "set")


def test_every_name_the_agent_and_the_legacy_script_generate_is_accepted() -> None:
    names = [backend_map(3), affinity_set(3), sticky_chain(3, 600), pattern_chain((0, 1, 2), None),
             pattern_chain((0, 1, 2), 600), pattern_chain(tuple(range(40)), None),
             "services", "dnat-5ecb64236646", "ep-5ecb64236646-1a2b3c4d", "aff-5ecb64236646-1a2b3c4d", "service-ips"]
    for name in names:
        assert T.add_chain(name, {})["add"]["chain"]["name"] == name
    assert Table("ip", "kube-ovn").add()["add"]["table"]["name"] == "kube-ovn"


@pytest.mark.parametrize("bad", ["", "a b", "9a", "-a", "x\\y", 'x"y', "é", "a" * 256, None, 7])
def test_a_name_the_agent_creates_must_be_an_nft_name(bad: Any) -> None:
    builds = [lambda: T.add_chain(bad, {}), lambda: T.add_set(bad, MAP), lambda: T.add_rule(bad, RULE),
              lambda: T.add_elements(bad, []), lambda: Table("ip", bad)]
    for build in builds:
        with pytest.raises(CommandError) as caught:
            build()
        assert caught.value.name == bad and repr(bad) in str(caught.value)
        assert isinstance(caught.value, ValueError)


def test_the_longest_name_is_255_bytes() -> None:
    assert T.add_chain("a" * 255, {})
    assert Table("ip", "a" * 255).add()


@pytest.mark.parametrize("held", ["a b", "", 'x"y', "é" * 127, "9a"])
def test_a_name_read_back_can_be_deleted_and_flushed_whatever_it_is(held: str) -> None:
    """Someone else's object in the agent's table goes, whatever its name: libnftables'
    JSON and the kernel take these (nft 1.0.6)."""
    assert T.delete_chain(held)["delete"]["chain"]["name"] == held
    assert T.flush_chain(held)["flush"]["chain"]["name"] == held
    assert T.delete_set(held, SET)["delete"]["set"]["name"] == held
    assert T.delete_elements(held, [])["delete"]["element"]["name"] == held
    assert T.destroy_elements(held, [])["destroy"]["element"]["name"] == held


@pytest.mark.parametrize("bad", [None, 7, "a\0b", "é" * 128, "a" * 256])  # "é" * 128: 128 characters, 256 bytes
def test_a_name_deleted_must_be_one_the_kernel_can_hold(bad: Any) -> None:
    builds = [lambda: T.delete_chain(bad), lambda: T.flush_chain(bad), lambda: T.delete_set(bad, MAP),
              lambda: T.delete_elements(bad, []), lambda: T.destroy_elements(bad, [])]
    for build in builds:
        with pytest.raises(CommandError) as caught:
            build()
        assert caught.value.name == bad and repr(bad) in str(caught.value)


def test_an_unknown_family_is_refused() -> None:
    with pytest.raises(CommandError, match="unknown family 'ipx'"):
        Table("ipx", "natgw")


@pytest.mark.parametrize("build, reason", [
    (lambda: T.add_set("aff_0", {"flags": ["dynamic"]}), "without a type"),
    (lambda: T.add_rule("slot_0", {"comment": "web"}), "without expressions"),
    (lambda: T.add_chain("slot_0", {"name": "other"}), r"carries \['name'\]"),
    (lambda: T.add_set("aff_0", {**SET, "table": "other"}), r"carries \['table'\]"),
    (lambda: T.add_rule("slot_0", {**RULE, "chain": "other", "family": "ip6"}), r"carries \['chain', 'family'\]"),
])
def test_a_body_that_would_replace_the_checked_names_or_lacks_its_core_is_refused(build: Any, reason: str) -> None:
    with pytest.raises(CommandError, match=reason):
        build()


def test_what_nft_text_may_name_is_narrower_than_an_nft_name() -> None:
    from agent.kernel.nft import IDENTIFIER as written_in_text  # kernel/nft.py takes it from core

    assert written_in_text is IDENTIFIER
    for name in ("natgw", "_x", "a" * 64, "backend_3"):
        assert IDENTIFIER.fullmatch(name) and NAME.fullmatch(name)
    for name in ("kube-ovn", "lb_s0.1.2", "a" * 65):
        assert not IDENTIFIER.fullmatch(name) and NAME.fullmatch(name)
