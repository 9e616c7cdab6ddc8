"""Capabilities probed, not assumed: on a fake that behaves as nft 1.0.6 (a list-typed map
declaration silently becomes a plain set; no destroy) and as 1.1.3."""
from __future__ import annotations

import pytest

from agent.kernel.caps import PROBE_MAP, probe
from agent.core.layout import BACKEND_DATA
from tests.fakenft import FakeNft, edges


@pytest.mark.parametrize("version, concat, destroy", [("1.0.6", False, False), ("1.1.3", True, True)])
def test_the_probe_reads_back_what_the_kernel_did(version: str, concat: bool, destroy: bool) -> None:
    fake = FakeNft(version)
    nft, view = edges(fake)
    caps = probe(nft, view, "ip", "natgw")
    assert (caps.json_concat_maps, caps.destroy) == (concat, destroy)
    assert PROBE_MAP not in fake.tables[("ip", "natgw")].sets  # the probe leaves nothing behind
    assert caps.as_dict()["json_concat_maps"] is concat


def test_a_refused_probe_takes_the_safe_path() -> None:
    fake = FakeNft("1.1.3")
    fake.fail_next(1, "Error: Could not process rule: Operation not permitted")
    nft, view = edges(fake)
    assert probe(nft, view, "ip", "natgw").json_concat_maps is False  # text declarations work everywhere


def test_what_each_probe_outcome_declares() -> None:
    fake = FakeNft("1.1.3")
    nft, view = edges(fake)
    probe(nft, view, "ip", "natgw")
    ref = {"family": "ip", "table": "natgw", "name": PROBE_MAP}
    declared = [c for b in fake.batches for c in b if "map" in c.get("add", {})]
    assert declared == [{"add": {"map": {**ref, "type": ["ipv4_addr", "inet_proto", "inet_service"],
                                         "map": BACKEND_DATA.split(" . ")}}}]
