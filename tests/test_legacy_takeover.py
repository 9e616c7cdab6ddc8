"""Taking over from the legacy script (agent/core/legacy.py): on legacy tables laid out as
nat-gateway.sh lays them out, built here from the script's own
naming (md5 of "eip:port:proto" and of "ip:port"), loaded into the fake, which refuses
to delete a missing object or one still referenced, as the kernel does.

Not test_legacy.py: pytest imports netns-tests/test_legacy.py under that module name in
the same run, and refuses a second file of that name."""
from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

import pytest

from agent.core.legacy import LEGACY_TABLE, takeover_commands
from agent.core.ruleset import EMPTY, ElemKey, Ruleset
from tests.builders import ROOT
from tests.fakenft import FakeNft
from tests.oracles import from_listing

EIP = "172.18.0.10"
REF = {"family": "ip", "table": LEGACY_TABLE}
SADDR = {"payload": {"protocol": "ip", "field": "saddr"}}


class Legacy(NamedTuple):
    """One identity as the controller hands it to the script."""

    port: int
    proto: str
    backends: tuple[tuple[str, int], ...]
    timeout: int | None = None  # ClientIP when set


WEB = Legacy(80, "tcp", (("10.0.1.11", 8080), ("10.0.1.12", 8080)))
APP = Legacy(443, "tcp", (("10.0.1.11", 9090), ("10.0.1.12", 9090)), timeout=600)
OTHER = Legacy(8443, "tcp", (("10.0.1.11", 9090),), timeout=600)  # shares a backend with APP
DNS = Legacy(53, "udp", (("10.0.1.12", 5353),))


def key(s: Legacy) -> ElemKey:
    return (EIP, s.proto, s.port)


def _md5(text: str, n: int) -> str:
    return hashlib.md5(text.encode()).hexdigest()[:n]


def dnat(s: Legacy) -> str:
    return f"dnat-{_md5(f'{EIP}:{s.port}:{s.proto}', 12)}"


def ep_suffixes(s: Legacy) -> list[str]:
    """The -<h>-<b> of each backend's ep- chain and aff- set (ClientIP only)."""
    h = dnat(s).removeprefix("dnat-")
    return [f"{h}-{_md5(f'{ip}:{port}', 8)}" for ip, port in s.backends] if s.timeout else []


def _numgen(n: int) -> dict[str, Any]:
    return {"numgen": {"mode": "random", "mod": n, "offset": 0}}


def script_commands(*services: Legacy) -> list[dict[str, Any]]:
    """What nat-gateway.sh leaves in `ip kube-ovn` for these identities, as JSON commands."""
    cmds: list[dict[str, Any]] = [
        {"add": {"table": {"family": "ip", "name": LEGACY_TABLE}}},
        {"add": {"map": {**REF, "name": "service-ips", "type": ["ipv4_addr", "inet_proto", "inet_service"],
                         "map": "verdict"}}},
        {"add": {"chain": {**REF, "name": "prerouting", "type": "nat", "hook": "prerouting", "prio": -150,
                           "policy": "accept"}}},
        {"add": {"rule": {**REF, "chain": "prerouting", "expr": [{"vmap": {
            "key": {"concat": [{"payload": {"protocol": "ip", "field": "daddr"}}, {"meta": {"key": "l4proto"}},
                               {"payload": {"protocol": "th", "field": "dport"}}]},
            "data": "@service-ips"}}]}}}]
    for s in services:
        proto = {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": s.proto}}
        rules: list[list[dict[str, Any]]] = []
        for suffix, (ip, port) in zip(ep_suffixes(s), s.backends):
            # `flags dynamic,timeout; timeout Ts`: listed by nft 1.0.6 (and read back) as below
            cmds.append({"add": {"set": {**REF, "name": f"aff-{suffix}", "type": "ipv4_addr", "flags": ["timeout"],
                                         "size": 65535}}})
            cmds.append({"add": {"chain": {**REF, "name": f"ep-{suffix}"}}})
            cmds += [{"add": {"rule": {**REF, "chain": f"ep-{suffix}", "expr": expr}}} for expr in (
                [{"set": {"op": "update", "elem": SADDR, "set": f"@aff-{suffix}"}}],
                [proto, {"dnat": {"addr": ip, "port": port}}])]
            rules.append([{"match": {"op": "==", "left": SADDR, "right": f"@aff-{suffix}"}},
                          {"goto": {"target": f"ep-{suffix}"}}])
        if s.timeout:
            rules.append([{"vmap": {"key": _numgen(len(s.backends)), "data": {"set": [
                [i, {"goto": {"target": f"ep-{suffix}"}}] for i, suffix in enumerate(ep_suffixes(s))]}}}])
        else:
            rules.append([proto, {"dnat": {"family": "ip", "addr": {"map": {"key": _numgen(len(s.backends)), "data": {
                "set": [[i, {"concat": [ip, port]}] for i, (ip, port) in enumerate(s.backends)]}}}}}])
        cmds.append({"add": {"chain": {**REF, "name": dnat(s)}}})
        cmds += [{"add": {"rule": {**REF, "chain": dnat(s), "expr": expr}}} for expr in rules]
        cmds.append({"add": {"element": {**REF, "name": "service-ips", "elem": [
            [{"concat": list(key(s))}, {"goto": {"target": dnat(s)}}]]}}})
    return cmds


def element_deleted(s: Legacy) -> dict[str, Any]:
    return {"delete": {"element": {**REF, "name": "service-ips", "elem": [{"concat": list(key(s))}]}}}


def loaded(*services: Legacy) -> FakeNft:
    fake = FakeNft()
    fake.external(script_commands(*services))
    return fake


def legacy_table(fake: FakeNft) -> Ruleset | None:
    return fake.view().read_other(LEGACY_TABLE)


def test_the_builder_lays_the_table_out_as_the_script_did() -> None:
    # The table nat-gateway.sh's text made in a real kernel (tests/fixtures/netlink),
    # listed by nft 1.0.6: the tests below stand on what the script really leaves.
    recorded = json.loads((ROOT / "tests" / "fixtures" / "netlink" / "nft-1.0.6.json").read_text())
    assert legacy_table(loaded(WEB, APP)) == from_listing(recorded["tables"]["ip kube-ovn"]["listing"])


def test_served_identities_lose_their_element_chains_and_sets_and_nothing_else() -> None:
    fake = loaded(WEB, APP, OTHER, DNS)
    served = [key(WEB), key(APP), (EIP, "tcp", 9000)]  # the last one the script never had
    commands = takeover_commands(legacy_table(fake), served)
    rc, _, err = fake.json_cmd({"nftables": commands})  # one transaction: the fake refuses a wrong order
    assert rc == 0, err
    assert legacy_table(fake) == legacy_table(loaded(OTHER, DNS))  # the others exactly as the script left them


def test_the_commands_name_only_the_served_identitys_objects() -> None:
    ep = [f"ep-{s}" for s in ep_suffixes(APP)]
    aff = [f"aff-{s}" for s in ep_suffixes(APP)]
    assert len(ep) == 2 and ep_suffixes(OTHER)[0] not in ep_suffixes(APP)  # one backend, two identities: two sets
    commands = takeover_commands(legacy_table(loaded(WEB, APP, OTHER)), [key(APP)])
    assert commands == [
        element_deleted(APP),
        *({"flush": {"chain": {**REF, "name": c}}} for c in [dnat(APP), *sorted(ep)]),
        *({"delete": {"chain": {**REF, "name": c}}} for c in [dnat(APP), *sorted(ep)]),
        *({"delete": {"set": {**REF, "name": s}}} for s in sorted(aff))]


def test_a_stateless_identity_has_only_its_dnat_chain() -> None:
    commands = takeover_commands(legacy_table(loaded(WEB, APP)), [key(WEB)])
    assert commands == [element_deleted(WEB), {"flush": {"chain": {**REF, "name": dnat(WEB)}}},
                        {"delete": {"chain": {**REF, "name": dnat(WEB)}}}]


def test_a_target_outside_the_scripts_naming_is_never_deleted() -> None:
    fake = loaded(WEB)
    fake.external([{"add": {"chain": {**REF, "name": "keep"}}},
                   element_deleted(WEB),
                   {"add": {"element": {**REF, "name": "service-ips", "elem": [
                       [{"concat": list(key(WEB))}, {"goto": {"target": "keep"}}]]}}}])
    assert takeover_commands(legacy_table(fake), [key(WEB)]) == [element_deleted(WEB)]  # not the chain "keep"


def test_nothing_without_a_legacy_table_or_a_served_identity_in_it() -> None:
    assert takeover_commands(None, [key(WEB)]) == []
    assert takeover_commands(EMPTY, [key(WEB)]) == []  # a table without the script's map
    assert takeover_commands(legacy_table(loaded(APP)), [key(WEB), key(DNS)]) == []
    assert takeover_commands(legacy_table(loaded(WEB)), []) == []


def test_legacy_objects_added_while_the_agent_did_not_listen_are_taken_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """The script re-adds a served identity while a large sync runs deaf (agent/kernel/view.py:
    nothing heard, only that someone committed): the drift check looks at the legacy
    table too, and asks for the full sync that takes it over again."""
    from agent.settings import Settings
    from tests.builders import eip, rule
    from tests.fakenft import edges, wired
    from tests.sources import Store

    monkeypatch.setattr("agent.run.reconcile.LARGE_TRANSACTION", 0)  # this one sync is large
    store = Store()
    store.put(eip("eip-web", EIP))
    store.put(rule("web", 80, "10.0.1.11"))
    fake = FakeNft()
    reconciler = wired(Settings(gateway="gw1", conntrack=False, take_over_legacy=True), *edges(fake))
    agents = fake.json_cmd

    def then_the_script(doc: Any) -> Any:
        out = agents(doc)
        if "services" in json.dumps(doc):  # the sync's own transaction, not a probe
            fake.json_cmd = agents  # type: ignore[method-assign]
            fake.external(script_commands(WEB))
        return out

    fake.json_cmd = then_the_script  # type: ignore[method-assign]
    reconciler.sync(store, None)
    assert reconciler.view.deaf_windows == 1 and legacy_table(fake) is not None
    assert reconciler.check_drift() is True  # a full sync is due: it takes the identity over
    reconciler.sync(store, None)
    assert key(WEB) not in legacy_table(fake).elements["service-ips"]
