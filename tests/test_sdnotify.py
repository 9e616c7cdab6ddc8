"""systemd's notify protocol: READY once, WATCHDOG at twice the rate systemd expects."""
from __future__ import annotations

import time

from agent.ops.health import Health


def test_systemd_notify_ready_after_first_sync_and_watchdog(tmp_path) -> None:
    import socket

    from agent.ops.sdnotify import Notifier

    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(2)
        notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
        health = Health(60, 30, notifier=notifier)
        health.beat()
        assert sock.recv(100) == b"WATCHDOG=1"
        health.beat()  # within half the watchdog period: not sent again
        health.synced()
        assert sock.recv(100) == b"READY=1\nSTATUS=programmed"
        health.synced()  # only once
        sock.settimeout(0.2)
        try:
            extra = sock.recv(100)
        except socket.timeout:
            extra = b""
        assert extra == b""


def test_the_watchdog_says_when_it_is_due() -> None:
    from agent.ops.sdnotify import Notifier

    assert Notifier({}).due() is None  # no watchdog: no timer for it
    notifier = Notifier({"WATCHDOG_USEC": "30000000"})
    notifier.watchdog()
    due = notifier.due()
    assert due is not None and 14.0 < due - time.monotonic() <= 15.0  # half the period from the last ping
