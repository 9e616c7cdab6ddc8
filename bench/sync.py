"""Control plane: programming N identities (full sync), one identity's change, and for the
agent a no-op sync, `show` and memory. Each case in a fresh namespace of its own."""
from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench import identities as ids_mod
from bench import kubeproxy, legacy
from bench.common import exec_in, namespace, python_in
from bench.nftcount import count

# Listing every set makes nft fetch each set's elements (a kernel lookup by name per set):
# with tens of thousands of sets that alone takes minutes. Above this, only elements and
# chains are counted.
FULL_COUNT_MAX_SETS = 5000
# One backend replaced is a handful of map-element operations in the agent's layout. A
# ClientIP backend replaced takes a slot no backend of its identity held (its predecessor's
# clients stay pinned in the old one until the cleanup deletes them): where no identity
# held that slot yet, its maps, sets and chains and the new pattern chain are declared
# (~13 commands), and the old slot's go if no one else holds it (~5).
# With the consistent choice, a ClientIP backend replaced also rewrites its buckets: a
# delete and an add in each bucket's map it changes (up to 61 each).
MAX_CHANGE_COMMANDS = 10
MAX_CHANGE_COMMANDS_CLIENTIP = 25 + 2 * 61


def max_change_commands(affinity: bool) -> int:
    return MAX_CHANGE_COMMANDS_CLIENTIP if affinity else MAX_CHANGE_COMMANDS


def _nft_jobs(ns: str, texts: list[str]) -> dict[str, Any]:
    """Run each text as its own `nft -f -` process inside the namespace, timed there."""
    jobs = [{"argv": ["nft", "-f", "-"], "input": t} for t in texts]
    return json.loads(python_in(ns, "bench.nsexec", input=json.dumps({"jobs": jobs})).stdout)


def _check_counts(ns: str, table: str, expected: dict[str, int]) -> dict[str, Any]:
    full = expected["sets"] <= FULL_COUNT_MAX_SETS
    got = count(ns, table, "service-ips", rules=full)
    if not full:
        got.pop("sets", None)
        got.pop("rules", None)
    want = {k: v for k, v in expected.items() if k in got}
    return {"expected": want, "got": got, "ok": all(got[k] == want[k] for k in want)}


def _chain_text(ns: str, table: str, chain: str) -> str:
    return exec_in(ns, ["nft", "list", "chain", "ip", table, chain]).stdout


def _change_check(ns: str, table: str, old: ids_mod.Identity, new: ids_mod.Identity, chain: str) -> dict[str, Any]:
    """The changed identity's chain now leads to the new backend and not to the old one."""
    text = _chain_text(ns, table, chain)
    new_b, old_b = new.backends[-1], old.backends[-1]
    if new.affinity or table == kubeproxy.TABLE:
        prefix = "ep" if table == legacy.TABLE else "endpoint"
        hit = f"{prefix}-{new.h}-{ids_mod.backend_hash(*new_b)}" in text
        stale = f"{prefix}-{old.h}-{ids_mod.backend_hash(*old_b)}" in text
    else:
        hit, stale = f"{new_b[0]} . {new_b[1]}" in text, f"{old_b[0]} . {old_b[1]}" in text
    return {"ok": hit and not stale, "new_backend_in_chain": hit, "old_backend_in_chain": stale, "method": "listing"}


def _referenced(ns: str, table: str, chain: str) -> bool:
    """True if the kernel refuses to delete the chain because a rule or map points at it."""
    proc = exec_in(ns, ["nft", "delete", "chain", "ip", table, chain], check=False)
    return proc.returncode != 0 and "Device or resource busy" in proc.stderr


def _fit_per_process(seconds: list[float]) -> tuple[float, float]:
    """Least squares t_i = a + b*i over the per-identity process times (i = identities
    already present), skipping the first tenth (warm-up)."""
    skip = len(seconds) // 10
    xs = list(range(skip, len(seconds)))
    ys = seconds[skip:]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _half_fit_check(seconds: list[float]) -> dict[str, float]:
    """The fit made on the first half of a run, summed over the whole run: how well the
    model extrapolates (to twice the identities) on data we have."""
    a, b = _fit_per_process(seconds[: len(seconds) // 2])
    n = len(seconds)
    return {"fitted_on": n // 2, "predicted": a * n + b * n * (n - 1) / 2}


def legacy_extrapolate(measured: dict[str, Any], n: int) -> dict[str, Any]:
    """Total of n per-identity processes from the fit of a measured run: sum a + b*i."""
    a, b = measured["fit"]
    return {"n": n, "affinity": measured["affinity"], "extrapolated_from": measured["n"], "seconds": a * n + b * n * (n - 1) / 2,
            "per_identity_first_ms": a * 1e3, "per_identity_last_ms": (a + b * (n - 1)) * 1e3}


def legacy_full(n: int, affinity: bool, do_change: bool) -> dict[str, Any]:
    idents = ids_mod.identities(n, affinity)
    with namespace() as ns:
        out = _nft_jobs(ns, [legacy.add_identity(x) for x in idents])
        sec = out["seconds"]
        res: dict[str, Any] = {
            "n": n, "affinity": affinity, "seconds": out["total"], "processes": len(sec),
            "per_identity_first_ms": statistics.fmean(sec[: max(1, n // 10)]) * 1e3,
            "per_identity_last_ms": statistics.fmean(sec[-max(1, n // 10):]) * 1e3,
            "fit": _fit_per_process(sec) if n >= 20 else (statistics.fmean(sec), 0.0),
            "half_fit_check": _half_fit_check(sec) if n >= 100 else None,
            "check": _check_counts(ns, legacy.TABLE, legacy.expected_objects(n, affinity, ids_mod.BACKENDS)),
        }
        if do_change:
            res["change"] = _legacy_change(ns, idents, n, setup=None)
    return res


def _legacy_change(ns: str, idents: list[ids_mod.Identity], n: int, setup: float | None) -> dict[str, Any]:
    i = ids_mod.changed_index(n)
    old, new = idents[i], ids_mod.changed(idents[i])
    out = _nft_jobs(ns, [legacy.add_identity(new)])
    return {"present": n, "seconds": out["total"], "processes": 1, "setup_s": setup,
            "check": _change_check(ns, legacy.TABLE, old, new, f"dnat-{new.h}")}


def legacy_change_at(n: int, affinity: bool) -> dict[str, Any]:
    """One identity's change with n present, the table loaded first in one batch (what the
    script would have left after n adds; loading it that way is not a measurement)."""
    idents = ids_mod.identities(n, affinity)
    with namespace() as ns:
        setup = _nft_jobs(ns, [legacy.state(idents)])["total"]
        check = _check_counts(ns, legacy.TABLE, legacy.expected_objects(n, affinity, ids_mod.BACKENDS))
        res = _legacy_change(ns, idents, n, setup)
        res["setup_check"] = check
        res["affinity"] = affinity
        return res


def kubeproxy_case(n: int, affinity: bool, do_change: bool, retire_delay: float = 1.0) -> dict[str, Any]:
    idents = ids_mod.identities(n, affinity)
    with namespace() as ns:
        out = _nft_jobs(ns, [kubeproxy.full(idents)])
        res: dict[str, Any] = {
            "n": n, "affinity": affinity, "seconds": out["total"], "processes": 1,
            "check": _check_counts(ns, kubeproxy.TABLE, kubeproxy.expected_objects(n, affinity, ids_mod.BACKENDS)),
        }
        if do_change:
            i = ids_mod.changed_index(n)
            old, new = idents[i], ids_mod.changed(idents[i])
            sync, cleanup = kubeproxy.change(old, new)
            first = _nft_jobs(ns, [sync])["total"]
            listable = kubeproxy.expected_objects(n, affinity, ids_mod.BACKENDS)["sets"] <= FULL_COUNT_MAX_SETS
            check = _change_check(ns, kubeproxy.TABLE, old, new, f"service-{new.h}") if listable else None
            time.sleep(retire_delay)
            try:
                later: float | None = _nft_jobs(ns, [cleanup])["total"]
            except RuntimeError:
                later = None  # the old chain still referenced (EBUSY) or missing
            if check is None:
                # Listing one chain makes nft 1.0.6 fetch every set's elements (minutes with
                # 40,000 sets); ask the kernel instead: a chain still referenced cannot be
                # deleted (EBUSY). The cleanup batch deleting the old endpoint chain proves
                # nothing points at it; the new one must refuse deletion.
                new_ref = _referenced(ns, kubeproxy.TABLE, kubeproxy.endpoint_chain(new, *new.backends[-1]))
                check = {"ok": new_ref and later is not None, "new_backend_in_chain": new_ref,
                         "old_backend_in_chain": later is None, "method": "delete probe"}
            elif later is None:
                check["ok"] = False
            res["change"] = {"present": n, "seconds": first, "cleanup_s": later, "processes": 1, "check": check}
    return res


def _loop_ok(out: dict[str, Any], n: int, affinity: bool) -> bool:
    """The run loop's path: a no-op sends nothing, the second change lands and costs little."""
    loop = out["change_loop"]
    ck = loop["kernel"]
    return (out["noop_loop_commands"] == 0 and 0 < loop["result"]["commands"] <= max_change_commands(affinity)
            and ck["changed_backends"] == ck["expected_backends"] and ck["identities"] == n
            and ck["backends"] == n * ids_mod.BACKENDS)


def agent_case(n: int, affinity: bool, retry_wait: float = 60.0, log: Callable[[str], None] = print,
               consistent: bool = True) -> dict[str, Any]:
    """The agent's driver in a fresh namespace on manifests written for n identities
    (`consistent`: settings.consistent_choice). If the agent's code fails (it may be
    mid-edit), wait and retry once."""
    idents = ids_mod.identities(n, affinity)
    rules = Path(tempfile.mkdtemp(prefix="natgw-bench-rules-"))
    try:
        files = ids_mod.write_manifests(rules, idents)
        for attempt in (1, 2):
            try:
                with namespace() as ns:
                    out = json.loads(python_in(ns, "bench.sync_driver", ["--dir", str(rules), "--n", str(n)]
                                               + (["--affinity"] if affinity else [])
                                               + ([] if consistent else ["--no-consistent-choice"])).stdout)
                break
            except (RuntimeError, ValueError) as err:  # the driver failed, or printed no result
                if attempt == 2:
                    return {"n": n, "affinity": affinity, "error": str(err)[-2000:]}
                log(f"  agent driver failed ({str(err).splitlines()[0]}); retrying in {retry_wait:.0f} s")
                time.sleep(retry_wait)
                ids_mod.write_manifests(rules, idents)  # the failed run may have rewritten one file
    finally:
        shutil.rmtree(rules, ignore_errors=True)
    out["files"] = files
    ck = out["change_kernel"]
    out["check"] = {
        "full_sync_ok": out["sync"]["identities"] == n and out["kernel"]["identities"] == n
        and out["kernel"]["backends"] == n * ids_mod.BACKENDS and out["sync"]["invalid"] == 0,
        "noop_ok": out["noop_commands"] == 0,
        "change_ok": ck["changed_backends"] == ck["expected_backends"] and ck["identities"] == n
        and ck["backends"] == n * ids_mod.BACKENDS and 0 < out["change"]["commands"] <= max_change_commands(affinity),
        "show_ok": out["show_rc"] == 0 and out["show_identities"] == n and out["show_backends"] == n * ids_mod.BACKENDS,
        "loop_path_ok": not out.get("incremental_api") or _loop_ok(out, n, affinity),
    }
    out["check"]["ok"] = all(out["check"].values())
    return out
