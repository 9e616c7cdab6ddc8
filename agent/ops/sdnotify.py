"""systemd's notify protocol (Type=notify, WatchdogSec=): READY=1 after the first sync,
WATCHDOG=1 while the loop turns. A datagram to $NOTIFY_SOCKET; nothing without it."""
from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address  # abstract namespace
        usec = int(env.get("WATCHDOG_USEC", "0") or 0)
        self._interval = usec / 2e6 if usec else None  # ping at twice the rate systemd expects
        self._last = float("-inf")
        self._ready = False

    def ready(self) -> None:
        if not self._ready:
            self._ready = True
            self._send("READY=1\nSTATUS=programmed")

    def watchdog(self) -> None:
        now = time.monotonic()
        if self._interval is not None and now - self._last >= self._interval:
            self._last = now
            self._send("WATCHDOG=1")

    def due(self) -> float | None:
        """When the next WATCHDOG=1 is due (monotonic; None: no watchdog)."""
        return None if self._interval is None else self._last + self._interval

    def _send(self, message: str) -> None:
        if not self._address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(message.encode(), self._address)
        except OSError:
            pass  # systemd gone: nothing to tell
