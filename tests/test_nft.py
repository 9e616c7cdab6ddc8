"""The nft edge: phases executed in order, one transaction each; the one place the agent
writes nft text (declarations nft 1.0.6's JSON parser cannot take: names and types only,
from a closed vocabulary); and a refusal that says whether an earlier phase committed."""
import pytest

from agent.errors import ApplyError
from agent.core.layout import BACKEND_DATA, IDENTITY_TYPE
from agent.kernel.nft import Nft, text_declaration
from agent.core.plan import needs_text, phased
from tests.fakenft import ENOENT, FakeNft

DECL = {"family": "ip", "table": "natgw", "name": "backend_3", "type": IDENTITY_TYPE, "map": BACKEND_DATA,
        "stmt": [{"counter": None}]}
ELEMENT = {"add": {"element": {"family": "ip", "table": "natgw", "name": "backend_3",
                               "elem": [[{"concat": ["172.18.0.10", "tcp", 80]}, {"concat": ["10.0.1.1", 8080]}]]}}}


def test_a_backend_map_declaration_in_nft_text():
    command = {"add": {"map": DECL}}
    assert needs_text(command)
    assert text_declaration(command) == ("add map ip natgw backend_3 { type ipv4_addr . inet_proto . inet_service"
                                         " : ipv4_addr . inet_service; counter; }")
    assert text_declaration({"add": {"table": {"family": "ip", "name": "natgw"}}}) == "add table ip natgw"
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


@pytest.mark.parametrize("table", [{"family": "ip", "name": "nat-gw"}, {"family": "inet", "name": "natgw"},
                                   {"family": "ip", "name": "natgw", "handle": 1}])
def test_a_table_outside_the_vocabulary_is_refused(table):
    with pytest.raises(ValueError):
        text_declaration({"add": {"table": table}})


def test_declarations_go_first_in_their_own_transaction_with_the_table():
    backend = FakeNft()
    nft = Nft("ip", "natgw", backend)
    nft.apply(phased([{"add": {"table": {"family": "ip", "name": "natgw"}}}, {"add": {"map": DECL}}, ELEMENT],
                     "ip", "natgw"))
    assert backend.texts == ["add table ip natgw\n" + text_declaration({"add": {"map": DECL}})]
    (batch,) = backend.batches  # everything else: one JSON transaction, without the declaration
    assert [next(iter(c["add"])) for c in batch] == ["table", "element"]
    assert nft.transactions == 2 and backend.generation() == 2
    assert backend.view().read().elements["backend_3"][("172.18.0.10", "tcp", 80)].value == ("10.0.1.1", 8080)


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_refused_batch_says_whether_an_earlier_part_committed(rebuild):
    backend = FakeNft()
    table = {"family": "ip", "name": "natgw"}
    backend.external([{"add": {"table": table}}])
    backend.refuse_if = lambda commands: ENOENT if any("element" in c.get("add", {}) for c in commands) else None
    commands = [*([{"delete": {"table": table}}] if rebuild else []), {"add": {"table": table}}, {"add": {"map": DECL}},
                ELEMENT]
    with pytest.raises(ApplyError) as refused:
        Nft("ip", "natgw", backend).apply(phased(commands, "ip", "natgw"))
    assert refused.value.partial is rebuild  # the table's delete had committed: the kernel changed
    assert backend.tables[("ip", "natgw")].sets["backend_3"].elems == {}  # the main phase did not


def test_nothing_to_send_sends_nothing():
    backend = FakeNft()
    nft = Nft("ip", "natgw", backend)
    nft.apply(phased([], "ip", "natgw"))
    assert nft.transactions == 0 and backend.generation() == 0
