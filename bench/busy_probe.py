"""Run inside the agent's namespace (child process of bench.busy): everything the busy
neighbour benchmark needs to do or see there, so that none of it runs in the agent's
process and none of it counts as the agent's CPU.

One JSON request per line on stdin, one JSON answer per line on stdout:

  {"op": "snapshot"}                   read the agent's table (agent.kernel.nftread.read_table) and
                                       keep it as "before"; identities, pinned clients
  {"op": "damage", "script": S, "watch": [[map, eip, proto, port]...], "timeout": T}
                                       `nft -f -` with S (one transaction), then poll every
                                       ~10 ms until the damaged part (declarations, chains,
                                       rules, and the watched map elements) is as before,
                                       and a full read confirms the whole table is
  {"op": "compare"}                    the table now against "before"
  {"op": "nft", "script": S}           `nft -f -` with S (untimed set-up)
  {"op": "run", "argv": [...], "parse": "show"|"show-json"|"diff"}
                                       a command's wall time, exit code and what it printed
  {"op": "scrape", "url": U}           one HTTP GET, timed
  {"op": "read"}                       one full read-back (KernelView.read()), timed
  {"op": "quit"}

The table is compared as the agent manages it (declarations, chains, rules, map
elements: agent.core.ruleset.Ruleset); affinity entries and counters are the kernel's to fill
and are compared only where asked (pinned clients)."""
from __future__ import annotations

import errno
import json
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from agent.kernel import nfnetlink as nl
from agent.kernel import nftread as nr
from agent.kernel import nftuapi as uapi
from agent.kernel.nftobjects import decode_set, elements_of
from agent.kernel.view import KernelView
from agent.kernel.nfnetlink import NetlinkError, NfSocket
from agent.core.ruleset import Elem, Ruleset, element

FAMILY, TABLE = "ip", "natgw"
POLL_INTERVAL = 0.01  # between the end of one poll and the start of the next


class Probe:
    def __init__(self) -> None:
        self.sock = NfSocket()
        self.before: Ruleset | None = None

    def _full(self) -> nr.TableState | None:
        return nr.read_table(FAMILY, TABLE, sock=self.sock)

    def _head(self) -> tuple[Any, ...] | None:
        st = nr.read_table(FAMILY, TABLE, elements=False, sock=self.sock)
        return None if st is None else (st.sets, st.chains, st.rules)

    def _element(self, name: str, key: tuple[str, str, int]) -> Elem | None:
        """One element of a map keyed by identity (address . protocol . port), asked of
        the kernel by its key (NFT_MSG_GETSETELEM without a dump: what `nft get element`
        does), decoded as agent.kernel.nftread decodes a dump; None if it is not there. A 10,000
        element map dumped and decoded whole takes ~0.2 s, this well under a ms."""
        fam = uapi.FAMILIES[FAMILY]
        info = decode_set(self.sock.request(uapi.NFT_MSG_GETSET, fam, [nl.attr_str(uapi.NFTA_SET_TABLE, TABLE),
                                                                       nl.attr_str(uapi.NFTA_SET_NAME, name)]).attrs(), fam)
        eip, proto, port = key
        raw = socket.inet_aton(eip) + struct.pack("=B3x", socket.getprotobyname(proto)) + struct.pack("!H2x", port)
        elements = nl.attr_nested(uapi.NFTA_SET_ELEM_LIST_ELEMENTS, [nl.attr_nested(uapi.NFTA_LIST_ELEM, [
            nl.attr_nested(uapi.NFTA_SET_ELEM_KEY, [nl.attr_bytes(uapi.NFTA_DATA_VALUE, raw)])])])
        try:
            m = self.sock.request(uapi.NFT_MSG_GETSETELEM, fam, [nl.attr_str(uapi.NFTA_SET_ELEM_LIST_TABLE, TABLE),
                                                                  nl.attr_str(uapi.NFTA_SET_ELEM_LIST_SET, name), elements])
        except NetlinkError as err:
            if err.errno == errno.ENOENT:
                return None
            raise
        if m is None:
            return None
        found = elements_of([m], info)
        return next((element(e.value, e.comment) for e in found if e.key == tuple(key)), None)

    def _partial_equal(self, watch: list[tuple[str, tuple[str, str, int]]]) -> bool:
        """The damaged part (declarations, chains and rules, and the watched map
        elements) as it was before: a few ms instead of a full read's ~0.3 s."""
        assert self.before is not None
        b = self.before
        if self._head() != (b.sets, b.chains, b.rules):
            return False
        return all(self._element(name, key) == b.elements.get(name, {}).get(key) for name, key in watch)

    def snapshot(self, _: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        st = self._full()
        seconds = time.perf_counter() - t0
        if st is None:
            self.before = None
            return {"exists": False}
        self.before = st.ruleset()
        return {"exists": True, "seconds": seconds, "identities": len(st.elements.get("services", {})),
                "elements": sum(len(e) for e in st.elements.values()), "chains": len(st.chains),
                "sets": len(st.sets), "entries": _entries(st)}

    def compare(self, _: dict[str, Any]) -> dict[str, Any]:
        st = self._full()
        return {"equal": st is not None and st.ruleset() == self.before,
                "entries": _entries(st) if st is not None else {}}

    def damage(self, req: dict[str, Any]) -> dict[str, Any]:
        """The damaging transaction, then polls: `repaired_s` runs from the moment `nft`
        returned to the end of the first poll that found the damaged part as before
        (so it is an upper bound, by at most one poll), confirmed by a full read (if that
        still differs, full reads go on until it does not)."""
        watch = [(w[0], (w[1], w[2], int(w[3]))) for w in req.get("watch", [])]
        timeout = float(req.get("timeout", 10.0))
        t_nft = time.perf_counter()
        proc = subprocess.run(["nft", "-f", "-"], input=req["script"], capture_output=True, text=True, check=False)
        t0 = time.perf_counter()
        out: dict[str, Any] = {"nft_s": t0 - t_nft, "nft_rc": proc.returncode, "nft_stderr": proc.stderr[-500:]}
        if proc.returncode != 0:
            return out
        polls: list[float] = []
        seen_damaged = False
        repaired_s = confirmed_s = None
        while time.perf_counter() - t0 < timeout:
            p0 = time.perf_counter()
            equal = self._partial_equal(watch)
            p1 = time.perf_counter()
            polls.append(p1 - p0)
            if equal:
                repaired_s = p1 - t0
                break
            seen_damaged = True
            time.sleep(POLL_INTERVAL)
        full_reads = 0
        while repaired_s is not None and time.perf_counter() - t0 < timeout:
            st = self._full()
            full_reads += 1
            if st is not None and st.ruleset() == self.before:
                confirmed_s = time.perf_counter() - t0
                break
            time.sleep(POLL_INTERVAL)
        repaired = confirmed_s is not None
        out.update({"repaired": repaired, "repaired_s": repaired_s, "confirmed_s": confirmed_s,
                    "full_reads": full_reads,
                    # the damaged part's return, if the full read right after agreed; else that full read's
                    "repair_s": (repaired_s if full_reads == 1 else confirmed_s) if repaired else None,
                    "seen_damaged": seen_damaged, "polls": len(polls),
                    "poll_s_median": sorted(polls)[len(polls) // 2] if polls else None,
                    "poll_s_max": max(polls) if polls else None})
        return out

    def nft(self, req: dict[str, Any]) -> dict[str, Any]:
        proc = subprocess.run(["nft", "-f", "-"], input=req["script"], capture_output=True, text=True, check=False)
        return {"rc": proc.returncode, "stderr": proc.stderr[-2000:]}

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        proc = subprocess.run(req["argv"], capture_output=True, text=True, timeout=float(req.get("timeout", 300)),
                              check=False)
        seconds = time.perf_counter() - t0
        out: dict[str, Any] = {"seconds": seconds, "rc": proc.returncode, "stdout_bytes": len(proc.stdout),
                               "stderr": proc.stderr[-2000:]}
        kind = req.get("parse")
        if kind == "show":
            lines = proc.stdout.splitlines()
            out["identities"] = sum(1 for line in lines if line and not line[0].isspace() and "affinity" in line)
            out["backends"] = sum(1 for line in lines if line.startswith("  -> "))
        elif kind == "show-json" and proc.returncode == 0:
            doc = json.loads(proc.stdout)
            out["identities"] = len(doc.get("identities", []))
            out["agent_ready"] = (doc.get("agent") or {}).get("ready")
        elif kind == "diff":
            out["empty"] = proc.stdout == ""
        return out

    def scrape(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req["url"], timeout=30) as r:
                status, body = r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            status, body = err.code, err.read().decode()
        seconds = time.perf_counter() - t0
        identities = next((line.split()[1] for line in body.splitlines() if line.startswith("natgw_identities ")), None)
        return {"seconds": seconds, "status": status, "bytes": len(body),
                "identities": float(identities) if identities is not None else None,
                "backend_series": body.count("\nnatgw_backend_packets_total{")}

    def read(self, _: dict[str, Any]) -> dict[str, Any]:
        view = KernelView(FAMILY, TABLE, subscribe=False)
        try:
            t0 = time.perf_counter()
            state = view.read_state()
            seconds = time.perf_counter() - t0
        finally:
            view.close()
        return {"seconds": seconds, "identities": len(state.elements.get("services", {})) if state is not None else 0,
                "attempts": state.attempts if state is not None else None}


def _entries(st: nr.TableState) -> dict[str, list[str]]:
    """Each affinity set's pinned clients, as text keys."""
    return {name: sorted(" . ".join(map(str, key)) for key, _ in found) for name, found in st.entries.items()}


def serve(ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> int:
    """Answer one JSON request a line until "quit" (or the end of stdin); an op that fails
    answers its error."""
    print(json.dumps({"ready": True}), flush=True)
    for req in map(json.loads, sys.stdin):
        if req["op"] == "quit":
            break
        try:
            answer = ops[req["op"]](req)
        except Exception as err:  # the parent reports it; the probe keeps serving
            answer = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(answer, default=str), flush=True)
    return 0


def main() -> int:
    probe = Probe()
    return serve({"snapshot": probe.snapshot, "compare": probe.compare, "damage": probe.damage, "nft": probe.nft,
                  "run": probe.run, "scrape": probe.scrape, "read": probe.read})


if __name__ == "__main__":
    sys.exit(main())
