"""What a namespace's nftables table holds, counted from the kernel (for correctness checks,
never timed): chains, named sets and maps, elements of one map, and rules."""
from __future__ import annotations

import json
from typing import Any

from bench.common import exec_in


def _json(ns: str, *what: str) -> list[dict[str, Any]]:
    out = exec_in(ns, ["nft", "-j", "list", *what], timeout=900).stdout
    return json.loads(out)["nftables"]


def count(ns: str, table: str, map_name: str, rules: bool = True) -> dict[str, int]:
    """chains, sets (named sets and maps), elements of `map_name`, and (if rules) rules."""
    result: dict[str, int] = {}
    if rules:
        items = _json(ns, "table", "ip", table)
        result["chains"] = sum("chain" in i for i in items)
        result["sets"] = sum(("set" in i or "map" in i) for i in items)
        result["rules"] = sum("rule" in i for i in items)
    else:
        result["chains"] = sum("chain" in i and i["chain"]["table"] == table for i in _json(ns, "chains", "ip"))
        result["sets"] = sum(("set" in i and i["set"]["table"] == table) or ("map" in i and i["map"]["table"] == table)
                             for i in _json(ns, "sets", "ip") + _json(ns, "maps", "ip"))
    items = _json(ns, "map", "ip", table, map_name)
    elems = next(i["map"] for i in items if "map" in i).get("elem", [])
    result["elements"] = len(elems)
    return result
