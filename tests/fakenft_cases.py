"""Transactions and what the kernel answers, shared by the fake's unit test
(tests/test_fakenft.py) and the same cases against the real kernel
(netns-tests/test_fakenft_kernel.py), so the fake's errors are the kernel's."""
from __future__ import annotations

from typing import Any

T = {"family": "ip", "table": "t"}
TABLE = {"add": {"table": {"family": "ip", "name": "t"}}}
KEY = ["ipv4_addr", "inet_proto", "inet_service"]


def _map(name: str, data: str = "verdict") -> dict[str, Any]:
    return {"add": {"map": {**T, "name": name, "type": KEY, "map": data}}}


def _chain(name: str, **decl: Any) -> dict[str, Any]:
    return {"add": {"chain": {**T, "name": name, **decl}}}


def _rule(chain: str, *expr: Any) -> dict[str, Any]:
    return {"add": {"rule": {**T, "chain": chain, "expr": list(expr)}}}


def _elem(name: str, *items: Any) -> dict[str, Any]:
    return {"add": {"element": {**T, "name": name, "elem": list(items)}}}


def _key(port: int) -> dict[str, Any]:
    return {"concat": ["172.18.0.10", "tcp", port]}


BASE_CHAIN = dict(type="nat", hook="prerouting", prio=-160, policy="accept")
GOTO_A = {"goto": {"target": "a"}}
# A base table: a verdict map with one element pointing at chain a, a set, and chain b
# whose rule reads the set.
SETUP = [TABLE, _map("m"), {"add": {"set": {**T, "name": "s", "type": KEY, "flags": ["timeout"], "size": 1024}}},
         _chain("pre", **BASE_CHAIN), _chain("a"), _chain("b"),
         _rule("b", {"match": {"op": "==", "left": {"concat": [{"payload": {"protocol": "ip", "field": "daddr"}},
                                                              {"meta": {"key": "l4proto"}},
                                                              {"payload": {"protocol": "th", "field": "dport"}}]},
                               "right": "@s"}}, {"accept": None}),
         _elem("m", [_key(80), GOTO_A])]

OK = "ok"
# name -> (transaction, OK or the error text the kernel gives: one of them, where nft
# versions word it differently)
CASES: dict[str, tuple[list[dict[str, Any]], str | tuple[str, ...]]] = {
    "add an existing table": ([TABLE], OK),
    "add an existing chain": ([_chain("a")], OK),
    "add an existing base chain as it is": ([_chain("pre", **BASE_CHAIN)], OK),
    "add an existing base chain with another priority": ([_chain("pre", **{**BASE_CHAIN, "prio": -150})],
                                                         ("Operation not supported",  # the kernel, via nft 1.0.6
                                                          "with different declaration")),  # nft 1.1.3 itself
    "add an existing map as it is": ([_map("m")], OK),
    "add an existing map with another type": ([_map("m", "ipv4_addr")], "File exists"),
    "add an existing element as it is": ([_elem("m", [_key(80), GOTO_A])], OK),
    "add an existing element with other data": ([_elem("m", [_key(80), {"goto": {"target": "b"}}])], "File exists"),
    "add one key twice with other data": ([_elem("m", [_key(81), GOTO_A], [_key(81), {"goto": {"target": "b"}}])],
                                          "File exists"),
    "add an element pointing at a missing chain": ([_elem("m", [_key(82), {"goto": {"target": "nope"}}])],
                                                   "No such file or directory"),
    "add an element to a missing map": ([_elem("nope", [_key(82), GOTO_A])], "No such file or directory"),
    "delete a missing element": ([{"delete": {"element": {**T, "name": "m", "elem": [_key(99)]}}}],
                                 "No such file or directory"),
    "delete a present and a missing element": (
        [{"delete": {"element": {**T, "name": "m", "elem": [_key(80), _key(99)]}}}], "No such file or directory"),
    "delete an element and add it back": ([{"delete": {"element": {**T, "name": "m", "elem": [_key(80)]}}},
                                           _elem("m", [_key(80), {"goto": {"target": "b"}}])], OK),
    "delete a chain a map element points at": ([{"delete": {"chain": {**T, "name": "a"}}}], "Device or resource busy"),
    "delete a chain a rule goes to": ([_chain("c"), _rule("c", {"goto": {"target": "b"}}),
                                       {"delete": {"chain": {**T, "name": "b"}}}], "Device or resource busy"),
    "delete a chain with rules nothing points at": ([{"delete": {"chain": {**T, "name": "b"}}}], OK),
    "delete a missing chain": ([{"delete": {"chain": {**T, "name": "nope"}}}], "No such file or directory"),
    "flush a missing chain": ([{"flush": {"chain": {**T, "name": "nope"}}}], "No such file or directory"),
    "delete a set a rule reads": ([{"delete": {"set": {**T, "name": "s"}}}], "Device or resource busy"),
    "flush the table, then delete the set": ([{"flush": {"table": {"family": "ip", "name": "t"}}},
                                              {"delete": {"set": {**T, "name": "s"}}}], OK),
    "delete a missing set": ([{"delete": {"set": {**T, "name": "nope"}}}], "No such file or directory"),
    "add a rule to a missing chain": ([_rule("nope", {"accept": None})], "No such file or directory"),
    "add a rule going to a missing chain": ([_rule("a", {"goto": {"target": "nope"}})], "No such file or directory"),
    "delete a missing table": ([{"delete": {"table": {"family": "ip", "name": "nope"}}}], "No such file or directory"),
    "a failing command undoes the whole transaction": ([_elem("m", [_key(83), GOTO_A]),
                                                        {"delete": {"chain": {**T, "name": "nope"}}}],
                                                       "No such file or directory"),
}
