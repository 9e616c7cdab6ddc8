"""The table's layout: names, and reading them back."""
from agent.layout import parse_target, pattern_chain


def test_pattern_chain_names():
    assert pattern_chain((0, 1, 2), None) == "lb_n3"
    assert pattern_chain((0, 2), 600) == "aff_t600_s0.2"
    long = pattern_chain(tuple(range(1, 200)), None)
    assert long.startswith("lb_h") and len(long) < 64
    for name in ("lb_n3", "aff_t600_s0.2", long):
        assert parse_target(name) is not None
    assert parse_target("prerouting") is None
