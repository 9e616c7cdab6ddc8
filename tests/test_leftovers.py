"""What a committed change leaves behind (agent/core/leftovers.py), on tables render.py makes."""
from __future__ import annotations

from agent.core.leftovers import NOTHING, leftovers
from agent.core.model import Identity
from agent.core.ruleset import EMPTY
from tests.builders import rendered, rule, web_objects

APP = ("172.18.0.10", "tcp", 443)


def test_a_start_from_an_empty_table_leaves_nothing() -> None:
    assert leftovers(EMPTY, rendered(web_objects())) == NOTHING


def test_an_unchanged_table_leaves_nothing() -> None:
    table = rendered(web_objects())
    assert leftovers(table, rendered(web_objects(), table)) == NOTHING


def test_identities_that_went_are_listed_and_only_they() -> None:
    before = rendered(web_objects())
    after = rendered([o for o in web_objects() if o["metadata"]["name"] not in ("dns-a", "web-a")], before)
    left = leftovers(before, after)
    assert left.gone == (Identity("172.18.0.10", 53, "udp"),)  # web lost one backend, not itself
    assert left.affinity == {}


def test_a_clientip_backend_that_left_its_slot_leaves_its_pins_there() -> None:
    other = rule("other", 444, "10.0.1.11", 9090, affinity="ClientIP", timeout=600)  # keeps aff_0 in use
    before = rendered([*web_objects(), other])
    objects = [o for o in web_objects() if o["metadata"]["name"] != "app-a"]
    objects += [other, rule("app-c", 443, "10.0.1.13", 9090, affinity="ClientIP", timeout=600)]
    left = leftovers(before, rendered(objects, before))
    assert left.gone == ()
    assert left.affinity == {0: frozenset({APP})}  # .11 held slot 0; its clients' entries are stale
    # Without another user of slot 0, its set goes with its entries: nothing to delete.
    alone = rendered(objects[:-2] + [objects[-1]], rendered(web_objects()))
    assert leftovers(rendered(web_objects()), alone).affinity == {}


def test_a_stateless_backend_that_left_leaves_no_pins() -> None:
    before = rendered(web_objects())
    after = rendered([o for o in web_objects() if o["metadata"]["name"] != "web-a"], before)
    assert leftovers(before, after) == NOTHING
