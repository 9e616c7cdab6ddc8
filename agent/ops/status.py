"""The agent's status on a unix socket: `natgw-agent health` and `show` ask it, nothing
on the network does. One line in ("ready", "live", "status", "memory"), one JSON document out,
from a thread of its own that never touches the kernel, so an answer takes well under a
second even while a sync runs."""
from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import structlog

log = structlog.get_logger()
QUERIES = ("ready", "live", "status", "memory")
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
                    conn.sendall(json.dumps({"ok": ok, **body}).encode() + b"\n")
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
