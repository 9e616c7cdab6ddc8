"""Imported at start-up by any Python process with this directory on PYTHONPATH (site.py
imports `sitecustomize`): with NATGW_MEMPROBE=<file> set and PYTHONTRACEMALLOC=1, SIGUSR1
writes agent/memory.py's `usage()` of the process, as JSON, to <file>. For agents that
have no memory query of their own (code before issue 13), so bench/footprint.py can say
where their memory went too. The usage() is this repository's, loaded under another name:
the process's own `agent` package is the code under test."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path

_OUT = os.environ.get("NATGW_MEMPROBE")
_MEMORY = Path(__file__).resolve().parent.parent.parent / "agent" / "memory.py"


def _dump(_signum: int, _frame: object) -> None:
    spec = importlib.util.spec_from_file_location("natgw_memprobe_memory", _MEMORY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tmp = Path(f"{_OUT}.tmp")
    tmp.write_text(json.dumps(module.usage()))
    tmp.replace(_OUT)  # type: ignore[arg-type]


if _OUT:
    signal.signal(signal.SIGUSR1, _dump)
