"""The process's memory around syncs: Python's cyclic collector, and glibc's malloc
under libnftables."""
from __future__ import annotations

import contextlib
import ctypes
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """A full sync allocates ~10 objects per rule while 100,000s stay alive; the cyclic
    collector would rescan them all many times over (measured: half of a 10k-identity
    sync). Reference counting still frees everything acyclic meanwhile. Afterwards every
    object alive (gc.freeze is process-wide: the sync's long-lived state, and whatever
    other threads hold) is frozen out of the collector, else the first collection after
    a full sync scans all of it (75 ms at 10k identities, then 210 ms for the next full
    one). Frozen objects are still freed by reference counting; cyclic garbage among them
    waits for collect_cycles(), once per resync interval."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.enable()


def collect_cycles() -> None:
    """Collect cyclic garbage among frozen objects too (once per resync interval: it scans
    the whole heap, ~0.2 s at 10,000 identities)."""
    gc.unfreeze()
    gc.collect()


def no_fastbins() -> None:
    """glibc malloc without fastbins, for this process (mallopt(M_MXFAST, 0)). libnftables
    allocates and frees some thirty small blocks per map element; with fastbins, glibc
    then spends ~15% of a large transaction consolidating them (measured at 10,000
    identities: 505 -> 436 ms). Python's own small objects use pymalloc, unaffected."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(1, 0)  # M_MXFAST = 1
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass
