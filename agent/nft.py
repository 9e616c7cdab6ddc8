"""libnftables at the edge: one JSON transaction per call, and reading the agent's own
table back. Nothing here ever names another table."""
from __future__ import annotations

import ctypes
import hashlib
import json
import re
from typing import Any, Callable, Protocol, Sequence

from agent.errors import ApplyError
from agent.ruleset import Key, Ruleset, concat_data, from_listing, key_json


class Libnftables(Protocol):
    """What the agent needs from libnftables; tests may stand in a failing one."""

    def json_cmd(self, doc: dict[str, Any]) -> tuple[int, Any, str]: ...
    def cmd(self, text: str) -> tuple[int, Any, str]: ...


_socket: Any = None


def _no_fastbins() -> None:
    """glibc malloc without fastbins, for this process (mallopt(M_MXFAST, 0)). libnftables
    allocates and frees some thirty small blocks per map element; with fastbins, glibc
    then spends ~15% of a large transaction consolidating them (measured at 10,000
    identities: 505 -> 436 ms). Python's own small objects use pymalloc, unaffected."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(1, 0)  # M_MXFAST = 1
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


class _Context:
    """A libnftables context (distro binding). json_cmd is the binding's, encoding the
    document without the cycle check and with compact separators: 30% less time on a
    10,000-identity batch (106 -> 76 ms), for the same parse on the other side."""

    def __init__(self) -> None:
        import nftables  # imported here so pure modules never need it

        _no_fastbins()
        self._ctx = nftables.Nftables()
        self._ctx.set_json_output(True)  # JSON out; and JSON in, which libnftables tries first
        self._ctx.set_handle_output(False)

    def json_cmd(self, doc: dict[str, Any]) -> tuple[int, Any, str]:
        rc, out, err = self._ctx.cmd(json.dumps(doc, check_circular=False, separators=(",", ":")))
        return rc, json.loads(out) if out else out, err

    def cmd(self, text: str) -> tuple[int, Any, str]:
        return self._ctx.cmd(text)  # type: ignore[no-any-return]


def _kernel_generation() -> int:
    """NFT_MSG_GETGEN over one netlink socket (pyroute2): one round trip, no listing."""
    global _socket
    from pyroute2.netlink.nfnetlink.nftsocket import NFT_MSG_GETGEN, NFTSocket, nft_gen_msg

    if _socket is None:
        _socket = NFTSocket()
    msg = nft_gen_msg()
    msg["nfgen_family"] = 0
    (answer,) = _socket.request_get(msg, NFT_MSG_GETGEN)
    return int(answer.get_attr("NFTA_GEN_ID"))


# What text_declaration() may write: names and types the agent itself generates.
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_TYPES = frozenset({"ipv4_addr", "inet_proto", "inet_service"})


def needs_text(command: dict[str, Any]) -> bool:
    body = command.get("add", {}).get("map")
    return isinstance(body, dict) and concat_data(body)


def text_declaration(command: dict[str, Any]) -> str:
    """The nft text for such a declaration, from a strictly checked closed vocabulary: it
    carries names and types only, never a value from a rule."""
    body = dict(command["add"]["map"])
    family, table, name = body.pop("family"), body.pop("table"), body.pop("name")
    key, data = body.pop("type"), str(body.pop("map")).split(" . ")
    stmt = body.pop("stmt", None)
    names_ok = all(isinstance(w, str) and IDENTIFIER.fullmatch(w) for w in (table, name))
    types_ok = isinstance(key, list) and all(isinstance(t, str) and t in _TYPES for t in (*key, *data))
    if body or family != "ip" or stmt not in (None, [{"counter": None}]) or not names_ok or not types_ok:
        raise ValueError(f"cannot declare map in nft text: {command!r}")
    return (f"add map {family} {table} {name} {{ type {' . '.join(key)} : {' . '.join(data)};"
            f"{' counter;' if stmt else ''} }}")


Counters = dict[tuple[str, str], tuple[int, int]]


def counters_of(doc: dict[str, Any]) -> Counters:
    """{("eip:port/proto", "ip:port"): (packets, bytes)} from the element counters of the
    backend_<slot> maps in a table listing."""
    result: Counters = {}
    for item in doc.get("nftables", []):
        body = item.get("map", {})
        if not str(body.get("name", "")).startswith("backend_"):
            continue
        for key, data in body.get("elem", []):
            elem = key.get("elem", {}) if isinstance(key, dict) else {}
            identity = elem.get("val", {}).get("concat", ()) if isinstance(elem.get("val"), dict) else ()
            backend = data.get("concat", ()) if isinstance(data, dict) else ()
            counter = elem.get("counter") or {}
            if len(identity) == 3 and len(backend) == 2:
                eip, proto, port = identity
                result[(f"{eip}:{port}/{proto}", f"{backend[0]}:{backend[1]}")] = (
                    int(counter.get("packets", 0)), int(counter.get("bytes", 0)))
    return result


def digest(commands: Sequence[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(commands, sort_keys=True).encode()).hexdigest()[:12]


class Nft:
    """The agent's table through one libnftables context (bound to the network namespace
    it is first used in: create it inside the gateway's namespace)."""

    def __init__(self, family: str, table: str, backend: Libnftables | None = None) -> None:
        self._genid: Callable[[], int] | None = None
        reader = backend
        if backend is None:
            backend, reader = _Context(), _Context()
            self._genid = _kernel_generation
            _kernel_generation()  # pyroute2's import and socket now, not in the first sync
        self.family = family
        self.table = table
        self._nft = backend
        # Listings go through a context of their own: a context that once listed the
        # table caches every element and refetches them all after the next commit
        # (measured: ~90 ms at 10,000 identities), which a transaction must not pay.
        self._reader = reader
        self.transactions = 0  # batches sent that changed something (for tests and metrics)

    def sibling(self, table: str) -> Nft:
        """The same context on another table of the family (only for --take-over-legacy)."""
        other = Nft.__new__(Nft)
        other.__dict__.update(self.__dict__)
        other.table = table
        return other

    def generation(self) -> int:
        """The kernel's ruleset generation: it moves with every committed transaction, of
        any table, and not with packets filling dynamic sets. A stand-in backend counts
        its own successful batches instead."""
        return self._genid() if self._genid is not None else self.transactions

    def apply(self, commands: Sequence[dict[str, Any]]) -> None:
        """Send commands as one atomic batch; raise ApplyError on failure.

        Maps that nft 1.0.6's JSON cannot declare (needs_text) are declared first, in a
        text transaction of their own: empty and unreferenced until the JSON batch
        commits, they change nothing in the data plane meanwhile, and a failed batch
        leaves at most those (the next read-back deletes them if unwanted). Only a batch
        that first deletes the table or such a map (plan() does so only to repair a
        declaration someone else altered) is split after those deletes, and so is not
        atomic: an ApplyError after they committed says `partial`."""
        if not commands:
            return
        declarations = [c for c in commands if needs_text(c)]
        rest = [c for c in commands if not needs_text(c)]
        if not declarations:
            self._json(rest)
            return
        if not IDENTIFIER.fullmatch(self.table):
            raise ValueError(f"table name {self.table!r} is not an nft identifier")
        texts = [text_declaration(c) for c in declarations]
        declared = {c["add"]["map"]["name"] for c in declarations}
        cut = max((i + 1 for i, c in enumerate(rest)
                   if "table" in c.get("delete", {}) or c.get("delete", {}).get("map", {}).get("name") in declared),
                  default=0)
        self._json(rest[:cut])
        try:
            self._text("\n".join([f"add table {self.family} {self.table}", *texts]), len(texts))
            self._json(rest[cut:])
        except ApplyError as err:
            err.partial = cut > 0
            raise

    def _json(self, commands: list[dict[str, Any]]) -> None:
        if not commands:
            return
        rc, _, err = self._nft.json_cmd({"nftables": commands})
        if rc != 0:
            raise ApplyError(rc, str(err), digest(commands), len(commands))
        self.transactions += 1

    def _text(self, text: str, count: int) -> None:
        rc, _, err = self._nft.cmd(text)
        if rc != 0:
            raise ApplyError(rc, str(err), hashlib.sha256(text.encode()).hexdigest()[:12], count)
        self.transactions += 1

    def read(self) -> Ruleset | None:
        """The table as the kernel holds it, or None if it does not exist."""
        doc = self._listing()
        return None if doc is None else from_listing(doc)

    def read_counted(self) -> tuple[Ruleset, Counters] | None:
        """The table and its per-backend counters from one listing (None: no table)."""
        doc = self._listing()
        return None if doc is None else (from_listing(doc), counters_of(doc))

    def backend_counters(self) -> Counters:
        """The per-backend counters (empty if the table cannot be listed)."""
        try:
            doc = self._listing()
        except ApplyError:
            return {}
        return {} if doc is None else counters_of(doc)

    def _listing(self) -> dict[str, Any] | None:
        rc, out, err = self._reader.json_cmd({"nftables": [{"list": {"table": {"family": self.family, "name": self.table}}}]})
        if rc != 0:
            if "No such file or directory" in str(err):
                return None
            raise ApplyError(rc, str(err), "list-table", 1)
        return out if isinstance(out, dict) else json.loads(out)

    def set_elements(self, name: str) -> list[Key]:
        """Keys of a (dynamic) set's elements."""
        rc, out, err = self._reader.json_cmd({"nftables": [{"list": {"set": {"family": self.family, "table": self.table, "name": name}}}]})
        if rc != 0:
            return []
        doc = out if isinstance(out, dict) else json.loads(out)
        keys: list[Key] = []
        for item in doc.get("nftables", []):
            for raw in item.get("set", {}).get("elem", []):
                if isinstance(raw, dict) and "elem" in raw:
                    raw = raw["elem"]["val"]
                keys.append(tuple(raw["concat"]) if isinstance(raw, dict) and "concat" in raw else (raw,))
        return keys

    def delete_elements(self, name: str, keys: Sequence[Key]) -> int:
        """Best-effort delete of set elements that may expire meanwhile; returns how many went."""
        if not keys:
            return 0
        ref = {"family": self.family, "table": self.table, "name": name}
        rc, _, _ = self._nft.json_cmd({"nftables": [{"delete": {"element": {**ref, "elem": [key_json(k) for k in keys]}}}]})
        if rc == 0:
            return len(keys)
        # One of them expired in between (ENOENT fails the whole batch): go one by one.
        done = 0
        for k in keys:
            rc, _, _ = self._nft.json_cmd({"nftables": [{"delete": {"element": {**ref, "elem": [key_json(k)]}}}]})
            done += rc == 0
        return done
