"""The one place the agent writes nft text: declarations of maps that nft 1.0.6's JSON
parser cannot declare. Names and types only, from a closed vocabulary."""
import pytest

from agent.nft import Nft, needs_text, text_declaration
from agent.render import BACKEND_DATA, IDENTITY_TYPE
from tests.test_incremental import Accepting

DECL = {"family": "ip", "table": "natgw", "name": "backend_3", "type": IDENTITY_TYPE, "map": BACKEND_DATA,
        "stmt": [{"counter": None}]}


def test_a_backend_map_declaration_in_nft_text():
    command = {"add": {"map": DECL}}
    assert needs_text(command)
    assert text_declaration(command) == ("add map ip natgw backend_3 { type ipv4_addr . inet_proto . inet_service"
                                         " : ipv4_addr . inet_service; counter; }")
    assert not needs_text({"add": {"map": {**DECL, "map": "verdict"}}})
    assert not needs_text({"delete": {"map": DECL}})


@pytest.mark.parametrize("field, value", [
    ("name", "backend_3; flush ruleset"), ("name", "b 3"), ("table", "natgw }"), ("family", "inet"),
    ("type", ["ipv4_addr", "ether_addr"]), ("type", [{"x": 1}]), ("type", "ipv4_addr"), ("map", "ipv4_addr . inet_service; flush ruleset"),
    ("map", "ipv4_addr . 8080"), ("stmt", [{"counter": {"packets": 1}}]), ("comment", "x"),
])
def test_anything_outside_the_vocabulary_is_refused(field, value):
    with pytest.raises(ValueError):
        text_declaration({"add": {"map": {**DECL, field: value}}})


def test_declarations_go_first_in_their_own_transaction_with_the_table():
    backend = Accepting()
    nft = Nft("ip", "natgw", backend)
    nft.apply([{"add": {"table": {"family": "ip", "name": "natgw"}}}, {"add": {"map": DECL}},
               {"add": {"element": {"family": "ip", "table": "natgw", "name": "backend_3",
                                    "elem": [[{"concat": ["172.18.0.10", "tcp", 80]}, {"concat": ["10.0.1.1", 8080]}]]}}}])
    assert backend.texts == ["add table ip natgw\n" + text_declaration({"add": {"map": DECL}})]
    (batch,) = backend.batches  # everything else: one JSON transaction, without the declaration
    assert [next(iter(c["add"])) for c in batch] == ["table", "element"]
    assert nft.transactions == 2


@pytest.mark.parametrize("table", ["nat-gw", "1natgw", "x" * 65, "natgw;"])
def test_a_table_name_nft_text_cannot_carry_is_refused_at_start(table, capsys):
    from agent.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--table", table, "show"])
    assert exit_.value.code == 2 and "--table" in capsys.readouterr().err


class RefusingElements(Accepting):
    def json_cmd(self, doc):  # type: ignore[no-untyped-def]
        if any("element" in c.get("add", {}) for c in doc["nftables"]):
            return 1, "", "Error: Could not process rule: No such file or directory"
        return super().json_cmd(doc)


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_refused_batch_says_whether_an_earlier_part_committed(rebuild):
    from agent.errors import ApplyError

    table = {"family": "ip", "name": "natgw"}
    commands = [*([{"delete": {"table": table}}] if rebuild else []), {"add": {"table": table}}, {"add": {"map": DECL}},
                {"add": {"element": {"family": "ip", "table": "natgw", "name": "backend_3",
                                     "elem": [[{"concat": ["172.18.0.10", "tcp", 80]}, {"concat": ["10.0.1.1", 8080]}]]}}}]
    with pytest.raises(ApplyError) as refused:
        Nft("ip", "natgw", RefusingElements()).apply(commands)
    assert refused.value.partial is rebuild  # the table's delete had committed: the kernel changed
