"""Active health checks of backends (issue 23), the pure half: what a check is, how a
rule's annotation says it, how results become up and down (rise/fall), and which backends
an identity offers new connections. Pure: no I/O. The probes themselves run in a thread of
their own (agent/health/prober.py); the loop feeds their results here.

A backend that is down leaves its identity's choice as if its rule were gone (render.py
sees only the usable backends): new connections avoid it, its ClientIP pins are deleted
(cleanup.py, as for a removed backend), and the consistent table (consistent.py) is
computed over the backends that are up, so two replicas that both saw the failure agree
again. Its established connections stay: conntrack is reconciled against the configured
backends, not the usable ones."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, NamedTuple, TypeAlias

if TYPE_CHECKING:  # model.py parses the annotation with this module
    from agent.core.model import Backend

ANNOTATION = "natgw.kube-ovn.io/health-check"
FIELD = f"metadata.annotations[{ANNOTATION}]"
OFF = "off"


class Check(NamedTuple):
    """One way to check a backend (a tuple: 40,000 targets are hashed on every full sync,
    and a frozen dataclass hashes its fields in Python each time). The defaults are HAProxy's `check inter 1s rise 2 fall 3`
    with keepalived's 1 s connect timeout: a dead backend is down after 3 failures (<= 3 s
    apart from the first, plus the sync: within the 5 s promised), back after 2 passes, and
    one that fails every other check never reaches 3 in a row, so it does not flap."""

    kind: str = "tcp"  # "tcp": a connect; "http": a GET whose status must be `status`
    interval: float = 1.0  # seconds between the starts of two checks of one backend
    timeout: float = 1.0  # seconds a check may take (connect, and for http the status line)
    rise: int = 2  # passes in a row that bring a down backend up
    fall: int = 3  # failures in a row that take an up backend down
    path: str = "/"  # http only
    status: int = 200  # http only: the status that passes
    port: int | None = None  # the port to check, if not the backend's own

    def __str__(self) -> str:
        text = f"{self.kind} interval={self.interval:g} timeout={self.timeout:g} rise={self.rise} fall={self.fall}"
        if self.kind == "http":
            text += f" path={self.path} status={self.status}"
        return text + (f" port={self.port}" if self.port is not None else "")


DEFAULT = Check()
Target: TypeAlias = "tuple[Backend, Check]"  # what one probe checks: the address (the check's port) and how


def target(backend: Backend, check: Check) -> Target:
    return (backend._replace(port=check.port) if check.port is not None else backend, check)


_SECONDS = re.compile(r"(\d+(?:\.\d+)?)(ms|s)?")
_PATH = re.compile(r"/[!-~]*")  # printable ASCII, no spaces: it goes into a request line


@functools.lru_cache(maxsize=1024)  # 40,000 rules a full sync, a few distinct annotations
def parse(text: str, proto: str, default: Check | None = DEFAULT) -> Check | None:
    """A rule's annotation: `off`, or a kind (`tcp`, `http`) and/or `key=value` words
    (interval, timeout in seconds or with `s`/`ms`; rise, fall, status, port integers; path
    for http), e.g. `http path=/healthz status=204 interval=2s`. Empty: the default for the
    protocol: a TCP backend is checked with `default` (None: not checked), a UDP one not at
    all. Unset values come from `default` (or DEFAULT). Raises ValueError with the reason."""
    words = text.split()
    if not words:
        return default if proto == "tcp" else None
    if words == [OFF]:
        return None
    base = default or DEFAULT
    kind = base.kind
    if "=" not in words[0]:
        kind, words = words[0], words[1:]
        if kind not in ("tcp", "http"):
            raise ValueError(f"{kind!r} is not off, tcp or http")
    values: dict[str, object] = {"kind": kind}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or key in values:
            raise ValueError(f"{word!r} is not a key=value setting given once")
        values[key] = _value(key, value, kind)
    check = base._replace(**values)  # type: ignore[arg-type]
    if check.timeout > check.interval:
        raise ValueError(f"timeout {check.timeout:g}s is longer than interval {check.interval:g}s")
    return check


def _value(key: str, value: str, kind: str) -> object:
    if key in ("interval", "timeout"):
        m = _SECONDS.fullmatch(value)
        seconds = float(m[1]) / (1000 if m[2] == "ms" else 1) if m else 0.0
        if not 0.05 <= seconds <= 3600:
            raise ValueError(f"{key}={value!r} is not a duration in 50ms..3600s")
        return seconds
    if key in ("rise", "fall", "status", "port"):
        low, high = {"rise": (1, 100), "fall": (1, 100), "status": (100, 599), "port": (1, 65535)}[key]
        if not (value.isascii() and value.isdigit() and low <= int(value) <= high):
            raise ValueError(f"{key}={value!r} is not an integer in {low}..{high}")
        if key == "status" and kind != "http":
            raise ValueError("status= is for http checks")
        return int(value)
    if key == "path":
        if kind != "http" or not _PATH.fullmatch(value) or len(value) > 1024:
            raise ValueError(f"path={value!r} is not an http check's absolute path")
        return value
    raise ValueError(f"{key!r} is not one of interval, timeout, rise, fall, path, status, port")


@dataclass(slots=True)
class State:
    """One target's health as the results so far say."""

    up: bool = True  # a new backend is up until it fails `fall` times: no traffic lost at a restart
    since: float = 0.0  # when it last changed (unix time; the agent's start for one never changed)
    streak: int = 0  # results in a row against the current state (passes while down, failures while up)
    last_failure: str = ""
    failed_at: float = 0.0
    checks: int = 0


class Tracker:
    """Rise and fall over each target's results (agent/run/checks.py serialises the calls).
    `down`: targets a previous run of the agent had found down; they start down (and need
    `rise` passes), so a restarted agent does not send connections to a dead backend for
    the `fall` checks it would take to find out again."""

    def __init__(self, now: float, down: Iterable[Target] = ()) -> None:
        self.started = now
        self.states: dict[Target, State] = {t: State(up=False, since=now) for t in down}
        # Kept as results come, not found by a scan: 10,000 backends failing at once came as
        # ~400 batches, and a scan of 40,000 states each was what kept the loop busy.
        self._down: set[Target] = set(self.states)

    def keep(self, targets: Iterable[Target]) -> None:
        """Track exactly these targets: new ones start up, gone ones are forgotten."""
        wanted = set(targets)
        for gone in [t for t in self.states if t not in wanted]:
            del self.states[gone]
            self._down.discard(gone)
        for new in wanted - self.states.keys():
            self.states[new] = State(since=self.started)

    def observe(self, target: Target, passed: bool, reason: str, now: float) -> bool:
        """A result; True when it changed the target's state."""
        state = self.states.get(target)
        if state is None:
            return False  # a target dropped while its check ran
        state.checks += 1
        if not passed:
            state.last_failure, state.failed_at = reason, now
        if passed != state.up:
            state.streak += 1
            if state.streak >= (target[1].rise if passed else target[1].fall):
                state.up, state.since, state.streak = passed, now, 0
                (self._down.discard if passed else self._down.add)(target)
                return True
        else:
            state.streak = 0
        return False

    def down(self) -> frozenset[Target]:
        return frozenset(self._down)

    def counts(self) -> tuple[int, int]:
        """Targets up, targets down."""
        return len(self.states) - len(self._down), len(self._down)


def dump(down: Iterable[Target]) -> list[list[object]]:
    """Down targets as JSON: [ip, port, kind, interval, timeout, rise, fall, path, status, check port]."""
    return sorted([b.ip, b.port, c.kind, c.interval, c.timeout, c.rise, c.fall, c.path, c.status, c.port]
                  for b, c in down)


def load(rows: Iterable[list[object]], backend: type) -> list[Target]:
    """dump()'s rows back as targets (`backend`: model.Backend); ValueError if malformed."""
    try:
        return [(backend(str(ip), int(port)), Check(str(kind), float(interval), float(timeout), int(rise),  # type: ignore[arg-type]
                                                    int(fall), str(path), int(status),  # type: ignore[arg-type]
                                                    None if cport is None else int(cport)))  # type: ignore[arg-type]
                for ip, port, kind, interval, timeout, rise, fall, path, status, cport in rows]
    except (TypeError, ValueError) as err:
        raise ValueError(f"not a list of down targets: {err}") from None


def usable(backends: tuple[Backend, ...], checks: tuple[Check | None, ...],
           down: frozenset[Target]) -> tuple[Backend, ...]:
    """The backends (each with its check, None: unchecked) that take new connections: those
    whose check is not down. Fail open: when every one is down, all of them (better a
    chance than a certain refusal)."""
    if not down:
        return backends
    up = tuple(b for b, c in zip(backends, checks) if c is None or target(b, c) not in down)
    return up if up and len(up) < len(backends) else backends
