"""Hostile rule files beside a valid one, against the real agent process, the real kernel
and real traffic: the agent survives, the valid identity works, every refused rule is
reported with its field, and nothing from the hostile input reaches the kernel."""
from __future__ import annotations

import json
import random
import signal
import string
import time
from pathlib import Path
from typing import Any

from gwtest import BACKENDS, EIP, OTHER_EIP, eip_doc, rule_doc, wait_for, write_rules, yaml_docs

WEB = [rule_doc(f"web-{n}", 80, ip) for n, ip in BACKENDS.items()]
B1 = BACKENDS["b1"]
INVALID = "invalid rule left out"

# Strings that must never show up in the kernel: each hostile object carries some.
MARKERS = ["evil", "flush", "drop", "pwned", "6.6.6.6", "1.2.3.4", "syntax-", "unicode-", "big-", "nan-",
           "other-80", "junk", "caf", "\u202e", "\U0001F600", "\uff11", "\x00"]


def write_bytes(directory: Path, name: str, data: bytes) -> None:
    """Atomically, like write_rules, for content that is not text."""
    tmp = directory / f".{name}.tmp"
    tmp.write_bytes(data)
    tmp.replace(directory / name)


def junk(size: int, seed: int) -> bytes:
    rnd = random.Random(seed)
    alphabet = string.printable + "{}[]:;,&*!|>'\"%@`#-?"
    return "".join(rnd.choice(alphabet) for _ in range(size)).encode()


def with_spec(name: str, port: int, **fields: Any) -> dict[str, Any]:
    """A valid rule of this gateway on `port` with some fields replaced."""
    doc = rule_doc(name, port, B1)
    doc["spec"].update(fields)
    return doc


# One hostile value per field, each on an otherwise valid rule: reported with that field.
SYNTAX_RULES = {
    "web-x; flush ruleset": ("metadata.name", rule_doc("web-x; flush ruleset", 82, B1)),
    "syntax-ext-port": ("spec.externalPort", with_spec("syntax-ext-port", 83, externalPort="80; add table ip evil")),
    "syntax-proto": ("spec.protocol", with_spec("syntax-proto", 84, protocol="tcp dport 80 drop")),
    "syntax-ip": ("spec.internalIp", with_spec("syntax-ip", 85, internalIp="10.0.1.11 } ; add table ip evil { }")),
    "syntax-int-port": ("spec.internalPort", with_spec("syntax-int-port", 86, internalPort="8080\nflush ruleset")),
    "syntax-affinity": ("spec.sessionAffinity", with_spec("syntax-affinity", 87, sessionAffinity="ClientIP; flush ruleset")),
    "syntax-timeout": ("spec.sessionAffinityTimeoutSeconds",
                       with_spec("syntax-timeout", 88, sessionAffinity="ClientIP", sessionAffinityTimeoutSeconds="600; drop")),
    "syntax-eip": ("spec.eip", rule_doc("syntax-eip", 89, B1, eip="eip-evil")),
    "unicode-port": ("spec.externalPort", with_spec("unicode-port", 90, externalPort="\uff19\uff11")),  # full-width 91
    "unicode-ip": ("spec.internalIp", with_spec("unicode-ip", 92, internalIp="\uff11\uff10.0.1.11")),
    "unicode-nul": ("spec.internalIp", with_spec("unicode-nul", 93, internalIp="10.0.1.11\x00")),
    "unicode\u202e-rtl": ("metadata.name", rule_doc("unicode\u202e-rtl", 94, B1)),
    "\U0001F600": ("metadata.name", rule_doc("\U0001F600", 95, B1)),
    "nan-port": ("spec.externalPort", None),  # in nan.json
}
SILENT = [  # not this gateway's share rules: left out without a word
    {"apiVersion": "kubeovn.io/v1", "kind": "IptablesDnatRule; flush ruleset", "metadata": {"name": "evil-kind"},
     "spec": rule_doc("x", 96, B1)["spec"]},
    with_spec("evil-type", 97, type="share; flush ruleset"),
    rule_doc("evil-owner", 98, B1, eip="eip-evil-owner"),
    {"apiVersion": "kubeovn.io/v1", "kind": "IptablesDnatRule",  # every field syntax-shaped
     "metadata": {"name": "} ; add table ip evil {", "uid": "; drop", "resourceVersion": "\n"},
     "spec": {k: "1.2.3.4; flush ruleset" for k in rule_doc("x", 1, B1)["spec"]}},
]
EVIL_EIPS = [eip_doc("eip-evil", "6.6.6.6; flush ruleset"),  # ours, with a bad address
             eip_doc("eip-evil-owner", "6.6.6.7", gateway="gw1; flush ruleset")]  # nobody's
BIG = [rule_doc(f"big-{i}", 81, list(BACKENDS.values())[i % 3], 8080 if i < 3 else 10000 + i) for i in range(10_000)]

NAN_JSON = ('{"apiVersion": "kubeovn.io/v1", "kind": "IptablesDnatRule", "metadata": {"name": "nan-port"}, '
            '"spec": {"eip": "eip-web", "type": "share", "protocol": "tcp", "externalPort": NaN, '
            '"internalIp": "10.0.1.11", "internalPort": Infinity, "sessionAffinityTimeoutSeconds": -Infinity}}')
JUNK_LIST = yaml_docs({"kind": "List", "apiVersion": "v1", "items": [
    1, "junk", None, [1, [2, [3]]], {"kind": 5}, {"metadata": "junk"}, {"kind": "IptablesDnatRule"},
    {"kind": "IptablesDnatRule", "metadata": {"name": 7}}, {"kind": "IptablesEIP", "metadata": {"name": ["junk"]}},
    {"kind": "IptablesDnatRule", "metadata": {"name": "junk-spec"}, "spec": ["share"]},
    {"kind": "IptablesEIP", "metadata": {"name": "junk-eip"}, "spec": "gw1", "status": [1]}]})
DEEP = b"[" * 50_000 + b"]" * 50_000
# Python 3.14's JSON parser takes 50,000 levels off the main thread (3.11-3.13 and every YAML
# loader raise RecursionError): one bracket short, so that no loader of any version can use it.
DEEP_CUT = DEEP[:-1]
UNPARSEABLE = {  # file -> content that no loader can use
    "deep.yaml": DEEP,
    "deep.json": DEEP_CUT,
    "deep-map.yaml": "".join(" " * i + "a:\n" for i in range(3000)).encode(),
    "junk.yaml": junk(2 * 1024 * 1024, 1),
    "binary.yaml": bytes(random.Random(2).randrange(256) for _ in range(256 * 1024)),
    "latin1.yaml": yaml_docs(rule_doc("cafe-junk", 99, B1)).replace("cafe", "caf\u00e9").encode("latin-1"),  # not UTF-8
}


def write_hostile(directory: Path) -> None:
    for name, data in UNPARSEABLE.items():
        write_bytes(directory, name, data)
    write_rules(directory, "nan.json", NAN_JSON)
    write_rules(directory, "junk-list.yaml", JUNK_LIST)
    write_rules(directory, "syntax.yaml", yaml_docs(*EVIL_EIPS, *(d for _, d in SYNTAX_RULES.values() if d), *SILENT))
    write_rules(directory, "big.json", json.dumps({"apiVersion": "v1", "kind": "List", "items": BIG}))
    write_rules(directory, "other-gw.yaml", yaml_docs(eip_doc("eip-other", OTHER_EIP, "gw2"),
                                                      rule_doc("other-80", 80, B1, eip="eip-other")))


def invalid(agent) -> list[dict[str, Any]]:
    return [e for e in agent.logs() if e.get("event") == INVALID]


def test_hostile_files_beside_a_valid_one(lab, agent):
    write_hostile(agent.rules_dir)
    time.sleep(1.0)  # let the agent chew on them first
    write_rules(agent.rules_dir, "rules.yaml", yaml_docs(eip_doc(), *WEB))
    agent.wait_services(1, timeout=15)

    # Alive, and the valid identity carries real traffic to all three backends.
    assert agent.proc.poll() is None
    real = lab.tcp_connect(EIP, 80, 30)
    assert real["failed"] == 0, real
    assert all(real["by_backend"][name] > 0 for name in BACKENDS), real
    assert list(agent.services()) == [(EIP, "tcp", 80)]

    # The 10,000-backend identity is refused as a whole; the other gateway's rule is not ours.
    assert lab.tcp_connect(EIP, 81, 3, timeout=0.5)["failed"] == 3
    assert lab.tcp_connect(OTHER_EIP, 80, 3, timeout=0.5)["failed"] == 3

    # Every refused rule is reported once, naming its field.
    expected = {name: field for name, (field, _) in SYNTAX_RULES.items()}
    expected.update({doc["metadata"]["name"]: "spec.internalIp" for doc in BIG})
    reports = wait_for(lambda: r if len(r := invalid(agent)) >= len(expected) else None, 15,
                       what=f"{len(expected)} invalid rules to be reported")
    assert {e["name"]: e["field"] for e in reports} == expected
    assert len(reports) == len(expected)  # once each
    assert all("limit 256" in e["reason"] and f"{EIP}:81/tcp" in e["reason"] for e in reports
               if e["name"].startswith("big-"))
    assert all(e["kind"] == "IptablesDnatRule" and e["reason"] for e in reports)

    # The kernel holds the agent's table and nothing else, with nothing of the hostile input.
    tables = json.loads(agent.nft("-j", "list", "tables"))["nftables"]
    assert [(t["table"]["family"], t["table"]["name"]) for t in tables if "table" in t] == [("ip", "natgw")]
    ruleset = agent.nft("list", "ruleset")
    assert [m for m in MARKERS if m in ruleset] == []
    assert ruleset.count("comment") == 1  # the services element's: web-b1,web-b2,web-b3
    assert 'comment "web-b1,web-b2,web-b3"' in ruleset
    assert agent.proc.poll() is None


def test_unparseable_files_are_reported_as_such_and_lose_no_change(lab, agent):
    """docs/input.md: a file that fails to parse keeps its last good content (logged). Written in
    the same moment as a valid file, it must neither hide that file's change nor be logged
    as anything but a parse failure."""
    for name, data in UNPARSEABLE.items():
        write_bytes(agent.rules_dir, name, data)
    write_rules(agent.rules_dir, "rules.yaml", yaml_docs(eip_doc(), *WEB))

    def reported() -> set[str]:
        return {Path(e["file"]).name for e in agent.logs() if e.get("event", "").startswith("cannot parse rules file")}

    try:
        wait_for(lambda: len(agent.services()) == 1 and reported() >= set(UNPARSEABLE), 5,
                 what="the valid identity and every unparseable file to be reported")
    except AssertionError:
        pass  # the assertion below says what is missing
    crashes = [e for e in agent.logs() if e.get("event") == "source poll failed"]
    last_lines = sorted({e.get("exception", "").strip().splitlines()[-1] for e in crashes if e.get("exception")})
    assert {
        "identities": list(agent.services()),
        "files not reported as unparseable": sorted(set(UNPARSEABLE) - reported()),
        "source poll failures": len(crashes),
        "their exceptions": last_lines,
    } == {"identities": [(EIP, "tcp", 80)], "files not reported as unparseable": [], "source poll failures": 0,
          "their exceptions": []}
    assert lab.tcp_connect(EIP, 80, 10)["failed"] == 0
    assert agent.proc.poll() is None


def test_nameless_objects_are_ignored_by_partial_syncs_as_by_full_syncs(lab, agent):
    """An object whose metadata.name is "" is skipped by a full sync (nothing to name or
    resolve it by). A partial sync (every change after the first) must do the same, or the
    kernel depends on which kind of sync ran last."""
    write_rules(agent.rules_dir, "rules.yaml", yaml_docs(eip_doc(), *WEB))
    agent.wait_services(1)
    write_rules(agent.rules_dir, "nameless.yaml", yaml_docs(
        eip_doc("", OTHER_EIP), rule_doc("sneaky", 80, B1, eip=""), rule_doc("", 82, BACKENDS["b2"])))
    time.sleep(1.0)
    after_partial = set(agent.services())
    answers = lab.tcp_connect(OTHER_EIP, 80, 3, timeout=0.5)["failed"] < 3
    nameless_reports = [e for e in invalid(agent) if e.get("name") == ""]
    # A restart starts with a full sync of the same files.
    assert agent.stop(signal.SIGTERM) == 0
    agent.start()
    wait_for(lambda: len([e for e in agent.logs() if e.get("event") == "starting"]) == 2, what="restart")
    time.sleep(1.5)
    after_full = set(agent.services())
    assert (after_partial, answers, len(nameless_reports)) == (after_full, False, 0), (
        f"partial sync: {sorted(after_partial)} (OTHER_EIP:80 answers: {answers}, reports naming '': "
        f"{len(nameless_reports)}); full sync: {sorted(after_full)}")
    assert after_full == {(EIP, "tcp", 80)}
