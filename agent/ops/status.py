"""The agent's status on a unix socket: `natgw-agent health` and `show` ask it, nothing
on the network does. One line in ("ready", "live", "status", "memory"), one JSON document out,
from a thread of its own that never touches the kernel, so an answer takes well under a
second even while a sync runs."""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import structlog

from agent import memory

log = structlog.get_logger()
QUERIES = ("ready", "live", "status", "memory")
# An answer this large (bytes) is followed by a malloc_trim: the status of 40,000 health
# targets (5.4 MB, with ~30 MB of objects while it is made) left glibc holding ~20 MB for
# good, 103 -> 119-124 MB resident at 10,000 x 4; trimmed, 100 -> 104-108 MB.
TRIM_AFTER = 1 << 20
Answer = Callable[[str], tuple[bool, dict[str, Any]]]


class StatusServer:
    """Serves `answer(query) -> (ok, body)` on a unix socket (mode 0600: root only)."""

    def __init__(self, path: Path, answer: Answer) -> None:
        self.path = Path(path)
        self._answer = answer
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.path.unlink()  # a previous run's socket: nobody listens on it any more
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._serve, name="status", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(1.0)  # a client that sends nothing must not hold the thread
                try:
                    query = conn.recv(64).decode("ascii", "replace").strip()
                    ok, body = self._answer(query) if query in QUERIES else (False, {"error": f"unknown query {query!r}"})
                    data = json.dumps({"ok": ok, **body}).encode() + b"\n"
                    del body
                    conn.sendall(data)
                    if len(data) > TRIM_AFTER:
                        del data
                        memory.trim()
                except (OSError, ValueError) as err:
                    log.debug("status query failed", error=str(err))


def query(path: Path, what: str, timeout: float = 1.0) -> dict[str, Any]:
    """Ask the agent; raises OSError (no agent listening, or no answer within `timeout`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(what.encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    answer = json.loads(data)
    if not isinstance(answer, dict):
        raise OSError(f"unexpected answer from {path}")
    return answer


def agent_status(path: Path) -> dict[str, Any] | None:
    """The running agent's status (capabilities, problems), None if none answers."""
    try:
        return query(path, "status")
    except (OSError, ValueError):
        return None


PROGRAMMED = "programmed"  # in the state directory: the first full sync of this pod is in the kernel


def routable(state_dir: Path) -> int:
    """`natgw-agent health --routable`, the readiness probe of a gateway whose readiness
    decides its traffic (an HA replica: kube-ovn routes to Ready pods only). Ready once this
    pod's data plane was programmed whole, and from then on whatever the API, the CRD check
    or a worker restarting does: the kernel serves the last good state meanwhile, and
    leaving the routes would only move this replica's connections elsewhere. Reads a file,
    not the agent: it answers while the worker restarts."""
    marker = state_dir / PROGRAMMED
    try:
        since = marker.stat().st_mtime
    except OSError:
        print(json.dumps({"ok": False, "reason": f"no full sync in this pod yet ({marker} absent)"}))
        return 1
    print(json.dumps({"ok": True, "programmedAt": since}))
    return 0


def health(path: Path, what: str, timeout: float) -> int:
    """`natgw-agent health`, an exec probe: asks the agent's status socket, never the kernel
    or the network; prints the answer, returns 0 if it says ok, else 1."""
    try:
        answer = query(path, what, timeout)
    except (OSError, ValueError) as err:
        print(f"natgw-agent health: no answer from {path}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(answer))
    return 0 if answer.get("ok") else 1
