"""The process's memory around syncs: Python's cyclic collector, and glibc's malloc
under libnftables."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import tracemalloc
from pathlib import Path
from typing import Any, Iterator


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


def trim() -> None:
    """Give the heap's free memory back to the kernel (glibc's malloc_trim): after a large
    transaction glibc keeps the ~135 MB libnftables used for 50,000 elements (measured:
    328 -> 193 MB resident at 10,000 identities x 4)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl returns memory on its own)
        pass


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def usage(top: int = 12) -> dict[str, Any]:
    """Where the process's memory is, for `natgw-agent show --memory` and the benchmark:
    resident and peak (the kernel's word), glibc's heap (in use, free but kept, mmapped),
    and, when the agent runs with PYTHONTRACEMALLOC=1, Python's objects by the file that
    allocated them. Tracing costs memory and a snapshot takes ~1 s at 10,000 identities:
    for finding where memory goes, not for production."""
    out: dict[str, Any] = resident(("VmRSS", "VmHWM", "RssAnon", "RssFile"))
    try:
        info = ctypes.CDLL(None).mallinfo2
        info.restype = _Mallinfo2
        m = info()
        out["malloc"] = {"heap_kib": m.arena // 1024, "in_use_kib": m.uordblks // 1024,
                         "free_kib": m.fordblks // 1024, "mmapped_kib": m.hblkhd // 1024}
    except (OSError, AttributeError):  # not glibc >= 2.33
        out["malloc"] = None
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        snapshot = tracemalloc.take_snapshot()
        out["python"] = {"traced_kib": current // 1024, "traced_peak_kib": peak // 1024,
                         "by_file": [{"file": _short(s.traceback[0].filename), "kib": s.size // 1024, "blocks": s.count}
                                     for s in snapshot.statistics("filename")[:top]],
                         "by_line": [{"line": f"{_short(s.traceback[0].filename)}:{s.traceback[0].lineno}",
                                      "kib": s.size // 1024, "blocks": s.count}
                                     for s in snapshot.statistics("lineno")[:2 * top]]}
    return out


def resident(fields: tuple[str, ...] = ("VmRSS", "VmHWM")) -> dict[str, int | None]:
    """The kernel's account of this process (KiB): resident now (VmRSS), at its peak
    (VmHWM), anonymous and file-backed parts."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    names = {"VmRSS": "rss_kib", "VmHWM": "peak_kib", "RssAnon": "anon_kib", "RssFile": "file_kib"}
    return {names[f]: int(status[f].split()[0]) if f in status else None for f in fields}


def limit(cgroups: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> float:
    """The memory limit of this process's cgroup (cgroup v2 `memory.max`: a container's
    limit, a systemd unit's MemoryMax), in bytes; +Inf when there is none or it cannot be
    read (cgroup v1, no memory controller)."""
    try:
        path = next(line[3:] for line in own.read_text().splitlines() if line.startswith("0::"))
        value = (cgroups / path.lstrip("/") / "memory.max").read_text().strip()
    except (OSError, StopIteration):
        return float("inf")
    return float("inf") if value == "max" else float(value)


def _short(filename: str) -> str:
    """A module's path from its package (site-packages/kubernetes/... -> kubernetes/...)."""
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1:])
    return "/".join(parts[-2:])
