"""libnftables at the edge, write-only: a plan's phases, one transaction each. The
agent reads its table over its own netlink (agent/kernel/view.py), never through a
libnftables listing. Nothing here ever names another table."""
from __future__ import annotations

import hashlib
import json
import subprocess
from typing import Any, Protocol, Sequence

from agent.errors import ApplyError
from agent.memory import no_fastbins
from agent.core.commands import IDENTIFIER
from agent.core.plan import DECLARE, PART, PREPARE, Plan


class Libnftables(Protocol):
    """What the agent needs from libnftables; tests stand in a fake that holds tables
    (tests/fakenft.py)."""

    def json_cmd(self, doc: dict[str, Any]) -> tuple[int, Any, str]: ...
    def cmd(self, text: str) -> tuple[int, Any, str]: ...
    def dry_run(self, doc: dict[str, Any]) -> int: ...


class _Context:
    """A libnftables context (distro binding). json_cmd is the binding's, encoding the
    document without the cycle check and with compact separators: 30% less time on a
    10,000-identity batch (106 -> 76 ms), for the same parse on the other side."""

    def __init__(self) -> None:
        import nftables  # imported here so pure modules never need it

        no_fastbins()
        self._ctx = nftables.Nftables()
        self._ctx.set_json_output(True)  # JSON out; and JSON in, which libnftables tries first
        self._ctx.set_handle_output(False)

    def json_cmd(self, doc: dict[str, Any]) -> tuple[int, Any, str]:
        rc, out, err = self._ctx.cmd(json.dumps(doc, check_circular=False, separators=(",", ":")))
        return rc, json.loads(out) if out else out, err

    def cmd(self, text: str) -> tuple[int, Any, str]:
        return self._ctx.cmd(text)  # type: ignore[no-any-return]

    def dry_run(self, doc: dict[str, Any]) -> int:
        """rc of the document checked by libnftables and the kernel, applied nowhere."""
        self._ctx.set_dry_run(True)
        try:
            return self.json_cmd(doc)[0]
        finally:
            self._ctx.set_dry_run(False)


# What text_declaration() may write: names (IDENTIFIER) and types the agent itself generates.
_TYPES = frozenset({"ipv4_addr", "inet_proto", "inet_service"})


def text_declaration(command: dict[str, Any]) -> str:
    """The nft text for a table or map declaration, from a strictly checked closed
    vocabulary: it carries names and types only, never a value from a rule."""
    if set(command) == {"add"} and set(command["add"]) == {"table"}:
        body = command["add"]["table"]
        if set(body) == {"family", "name"} and body["family"] == "ip" and isinstance(body["name"], str) \
                and IDENTIFIER.fullmatch(body["name"]):
            return f"add table ip {body['name']}"
        raise ValueError(f"cannot declare table in nft text: {command!r}")
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


def digest(commands: Sequence[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(commands, sort_keys=True).encode()).hexdigest()[:12]


class Nft:
    """Writes to the agent's table through one libnftables context (bound to the network
    namespace it is first used in: create it inside the gateway's namespace)."""

    def __init__(self, family: str, table: str, backend: Libnftables | None = None) -> None:
        self.family = family
        self.table = table
        self._nft = backend if backend is not None else _Context()
        self.transactions = 0  # transactions committed (for tests and metrics)

    def apply(self, plan: Plan) -> None:
        """Send a plan, one transaction per phase, in order; raise ApplyError on failure
        (`partial` when an earlier phase that changes the data plane had committed: the
        deletes before a text declaration, or earlier identities of a chunked plan)."""
        committed = False
        for phase in plan.phases:
            try:
                if phase.kind == DECLARE:
                    self._text("\n".join(text_declaration(c) for c in phase.commands), len(phase.commands))
                else:
                    self._json(list(phase.commands))
            except ApplyError as err:
                err.partial = committed
                raise
            committed |= phase.kind in (PREPARE, PART)

    def version(self) -> str:
        """nftables' version, as `nft --version` says (for the record only: what the agent
        does depends on probed capabilities, agent/kernel/caps.py). Not from a libnftables listing:
        even a list of tables is unsafe on 1.0.6, which prints another process's `flags
        owner` table as broken JSON and then corrupts its heap (seen here)."""
        try:
            done = subprocess.run(["nft", "--version"], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return "unknown"
        words = done.stdout.split()
        return words[1].lstrip("v") if done.returncode == 0 and len(words) > 1 else "unknown"

    def accepts(self, commands: list[dict[str, Any]]) -> bool:
        """Whether libnftables and the kernel take these commands (a dry run)."""
        return self._nft.dry_run({"nftables": commands}) == 0

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
