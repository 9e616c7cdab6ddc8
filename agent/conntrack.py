"""Conntrack cleanup at the edge (the conntrack tool, argv only: values never pass a shell).

NAT chains see only a flow's first packet, so a flow keeps its backend for as long as its
conntrack entry lives: entries must go when their identity (or, for UDP, their backend)
does, or a client keeps sending into a black hole."""
from __future__ import annotations

import re
import subprocess

import structlog

from agent.model import Backend, Identity

log = structlog.get_logger()
_DELETED_RE = re.compile(r"(\d+) flow entries have been deleted")


def delete_flows(identity: Identity, backend: Backend | None = None) -> int:
    """Delete entries whose original destination is the identity (and, if given, whose
    reply comes from that backend). Returns how many went; never raises."""
    argv = ["conntrack", "-D", "-p", identity.proto, "--orig-dst", identity.eip, "--dport", str(identity.port)]
    if backend is not None:
        argv += ["--reply-src", backend.ip, "--reply-port-src", str(backend.port)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("conntrack delete failed", identity=str(identity), backend=str(backend or ""), error=str(err))
        return 0
    m = _DELETED_RE.search(done.stderr + done.stdout)
    return int(m.group(1)) if m else 0
