"""The status socket: one line in, one JSON document out, from a thread of its own."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from agent.kernel.caps import Capabilities
from agent.ops.health import Health
from agent.ops.status import StatusServer, query


def test_ready_live_and_status_are_answered(tmp_path: Path) -> None:
    health = Health(60, 30)
    server = StatusServer(tmp_path / "agent.sock", health.answer(Capabilities(nft_version="9.9")))
    try:
        assert query(server.path, "ready")["ok"] is False  # no full sync yet
        health.synced()
        assert query(server.path, "ready") == {"ok": True, "status": "ok"}
        assert query(server.path, "live")["ok"] is True
        status = query(server.path, "status")
        assert status["ready"] and status["capabilities"]["nft_version"] == "9.9" and status["problems"] == []
        health.problems.append("the CRD lacks spec.type")
        assert query(server.path, "ready") == {"ok": False, "status": "not ready", "reason": "the CRD lacks spec.type"}
        assert query(server.path, "nonsense")["ok"] is False
        assert oct(server.path.stat().st_mode & 0o777) == "0o600"
    finally:
        server.close()
    assert not server.path.exists()


def test_a_silent_client_does_not_hold_up_the_next(tmp_path: Path) -> None:
    server = StatusServer(tmp_path / "agent.sock", Health(60, 30).answer(Capabilities()))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            silent.connect(str(server.path))  # says nothing
            started = time.monotonic()
            assert query(server.path, "live", timeout=3.0)["ok"] is True
            assert time.monotonic() - started < 3.0  # answered once the silent one timed out (1 s)
    finally:
        server.close()


def test_no_agent_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        query(tmp_path / "absent.sock", "ready")


def test_a_large_answer_gives_the_heap_back_after_it_is_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """40,000 health targets' status (5.4 MB) left glibc holding ~20 MB for good: the
    server trims after an answer over TRIM_AFTER, and only then."""
    from agent.ops import status

    trims: list[int] = []
    monkeypatch.setattr(status.memory, "trim", lambda: trims.append(1))
    rows = [{"backend": f"10.1.{i // 250}.{i % 250}:8080", "up": True} for i in range(40000)]
    server = StatusServer(tmp_path / "agent.sock", Health(60, 30).answer(Capabilities(), lambda: {"targets": rows}))
    try:
        assert query(server.path, "live")["ok"] is True
        assert trims == []
        assert len(query(server.path, "status", timeout=10.0)["health"]["targets"]) == 40000
        deadline = time.monotonic() + 5
        while not trims and time.monotonic() < deadline:  # after the answer is sent: the server's thread
            time.sleep(0.01)
        assert trims == [1]
    finally:
        server.close()
