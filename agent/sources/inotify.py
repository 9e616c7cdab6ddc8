"""inotify on one directory, non-blocking, through libc (ctypes): what the directory
source sleeps on instead of polling. (pyroute2 ships an inotify, but blocking and with a
fixed mask; this is the 40 lines the source needs.)"""
from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import NamedTuple

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

WATCHED = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
           | IN_DELETE_SELF | IN_MOVE_SELF)
COMPLETE = IN_CLOSE_WRITE | IN_MOVED_TO  # the file is whole: written and closed, or renamed in
GONE_SELF = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len


class Event(NamedTuple):
    mask: int
    name: str


class Inotify:
    """Watches one directory; raises OSError where inotify cannot be had."""

    def __init__(self, directory: str) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if libc.inotify_add_watch(self._fd, os.fsencode(directory), WATCHED) < 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"cannot watch {directory}: {os.strerror(err)}")

    def fileno(self) -> int:
        return self._fd

    def read(self) -> list[Event]:
        """Every event queued now, without blocking."""
        events: list[Event] = []
        while True:
            try:
                data = os.read(self._fd, 65536)
            except OSError as err:
                if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return events
                raise
            offset = 0
            while offset + _EVENT.size <= len(data):
                _, mask, _, length = _EVENT.unpack_from(data, offset)
                raw = data[offset + _EVENT.size:offset + _EVENT.size + length].rstrip(b"\0")
                events.append(Event(mask, os.fsdecode(raw)))
                offset += _EVENT.size + length

    def close(self) -> None:
        os.close(self._fd)
