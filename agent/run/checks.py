"""The loop's side of the health checks (issue 23): which targets the prober's thread
checks (agent/health/prober.py), their results counted into up and down
(agent/core/health.py's Tracker), and what a transition changes: the planner renders the
identities it touches at the next sync, and it is logged, counted and (on the Kubernetes
path) recorded as an Event on the rules behind the backend.

The prober never waits on the loop (a lock held for a dict update), and the loop never
waits on a check."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Collection, Protocol

import structlog

from agent.core.health import State, Target, Tracker, dump, load
from agent.core.model import Backend

log = structlog.get_logger()


class Probes(Protocol):
    """agent/health/prober.py's Prober (in unit tests, a fake)."""

    @property
    def stretch(self) -> float: ...
    def set_targets(self, targets: Collection[Target]) -> None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...


Transition = tuple[Target, State]  # a target whose state just changed, and that state
KEEP_EVERY = 5.0  # seconds between writes of the down targets (monotonic)


class HealthChecks:
    """Feeds the prober its targets and counts its results as they come, in the prober's
    thread (result()): only the first transition since the last drain wakes the loop,
    which calls follow(), drain(), down() and snapshot(). At 40,000 targets a second,
    waking the loop per result would cost it more than the checks themselves."""

    def __init__(self, prober: Callable[[Callable[[Target, bool, str], None]], Probes],
                 clock: Callable[[], float] = time.time, remember: Path | None = None) -> None:
        self.clock = clock
        self.wake: Callable[[], None] = lambda: None  # the loop's waker (set by the loop)
        self._lock = threading.Lock()
        self.remember = remember  # where the down targets are kept for the next run (the state directory)
        self.tracker = Tracker(clock(), self._recall())
        self._transitions: list[Transition] = []
        self.prober = prober(self.result)
        self.failing_open: list[str] = []  # identities whose every backend is down (the loop sets it)
        self._unkept = False  # transitions since the down targets were last written
        self._kept_at = -KEEP_EVERY

    def result(self, target: Target, passed: bool, reason: str) -> bool:
        """A check's result (the prober's thread); whether the target is between states,
        so that the prober checks it again soon."""
        with self._lock:
            changed = self.tracker.observe(target, passed, reason, self.clock())
            first = changed and not self._transitions
            if changed:
                self._transitions.append((target, replace(self.tracker.states[target])))
            state = self.tracker.states.get(target)
            between = state is not None and state.streak > 0
        if first:  # the loop then looks when its batch is due (it keeps a timer while any wait)
            self.wake()
        return between

    def follow(self, targets: Collection[Target]) -> None:
        """Check exactly these targets (after a sync changed them)."""
        wanted = frozenset(targets)
        with self._lock:
            self.tracker.keep(wanted)
        self.prober.set_targets(wanted)

    @property
    def pending(self) -> bool:
        """Transitions wait for drain() (a list's truth, read without the lock)."""
        return bool(self._transitions)

    def drain(self) -> list[Transition]:
        """The transitions since the last drain, in order."""
        with self._lock:
            found, self._transitions = self._transitions, []
        if found:
            self._unkept = True
        return found

    def keep_due(self) -> float | None:
        """When keep_down() has something to write (monotonic; None: nothing)."""
        return self._kept_at + KEEP_EVERY if self._unkept and self.remember is not None else None

    def keep_down(self, now: float, force: bool = False) -> None:
        """Write the down targets for the next run, if they changed since the last write
        and it was KEEP_EVERY ago (or `force`: at the end). 10,000 down targets take ~20 ms
        to write: not at every batch of a mass failure; a kill within KEEP_EVERY of a
        transition loses only that (the checks find it again)."""
        if not (self._unkept or self._transitions) or self.remember is None or (
                not force and now - self._kept_at < KEEP_EVERY):
            return
        self._unkept, self._kept_at = False, now
        down = self.down()
        try:
            tmp = self.remember.with_suffix(".tmp")
            tmp.write_text(json.dumps(dump(down)))
            tmp.replace(self.remember)
        except OSError as err:
            log.warning("cannot keep the down backends for the next run", path=str(self.remember), error=str(err))

    def _recall(self) -> list[Target]:
        """The targets the previous run had down (in a pod: the agent restarted in place)."""
        if self.remember is None:
            return []
        try:
            return load(json.loads(self.remember.read_text()), Backend)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            log.warning("forgetting what a previous run found down", path=str(self.remember), error=str(err))
            return []

    def counts(self) -> tuple[int, int]:
        """Targets up, targets down."""
        with self._lock:
            return self.tracker.counts()

    def down(self) -> frozenset[Target]:
        with self._lock:
            return self.tracker.down()

    def snapshot(self) -> dict[str, Any]:
        """For `natgw-agent show` (the status socket's thread): every target's state, since
        when, its last failure; and how far the CPU budget stretched the intervals."""
        # The fields, not copies of the states: the prober and the loop wait on this lock
        # (at 40,000 targets: 10-25 ms, against 40-55 ms for dataclasses.replace).
        with self._lock:
            held = [(t, s.up, s.since, s.checks, s.last_failure, s.failed_at) for t, s in self.tracker.states.items()]
        rows = []
        for (backend, check), up, since, checks, last_failure, failed_at in sorted(
                held, key=lambda item: (str(item[0][0]), str(item[0][1]))):
            row: dict[str, Any] = {"backend": str(backend), "check": str(check), "up": up, "since": since,
                                   "checks": checks}
            if last_failure:
                row.update(lastFailure=last_failure, failedAt=failed_at)
            rows.append(row)
        # "down" as the state file keeps it: `natgw-agent diff` plans with it, as a sync would.
        return {"stretch": self.prober.stretch, "targets": rows, "failOpen": list(self.failing_open),
                "down": dump(item[0] for item in held if not item[1])}
