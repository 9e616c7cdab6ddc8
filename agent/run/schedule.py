"""When the loop has work, as a small object of its own on an injected clock (kube-proxy's
BoundedFrequencyRunner is the model): a sync is pending from a change until it lands;
changes arriving together within a few milliseconds go as one; a failed sync is retried
after a capped, jittered backoff; a full resync comes every settings.resync_interval; a
drift check follows kernel notifications once no sync is pending; and an idle loop wakes
at most every settings.idle_wakeup. It does no I/O: the loop asks it what is due and tells
it what happened, so every rule here is tested with a fake clock (tests/test_schedule.py)."""
from __future__ import annotations

import time
from typing import Callable, Iterable

from agent.backoff import Backoff
from agent.settings import Settings

# Quiet that ends the wait for more changes: after a lone change, 1 ms (its own latency);
# within a burst, 2.5 ms: a burst of 20 watch events arrived here with gaps of 0.2-2.2 ms
# (bench/footprint.py), and a 1 ms quiet cut 2 bursts of 10 in two transactions.
LONE_QUIET = 0.001
BURST_QUIET = 0.0025


class Schedule:
    """The loop's timers and flags. `clock` is monotonic (timers); `wall` is unix time
    (when a change was seen, for the programming latency and the last-queued gauge)."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, backoff: Backoff | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.wall = wall
        self.backoff = backoff or Backoff(settings.retry_min, settings.retry_max)
        self.pending = True  # a sync is wanted: the first one, from the start
        self.queued_at = wall()  # when the oldest change not yet in the kernel was seen
        self.retry_at = 0.0
        self.resync_at = clock() + settings.resync_interval
        self.drift_due = False  # kernel notifications arrived that no drift check has looked at

    def queue(self, seen_at: float | None = None) -> None:
        """A sync is wanted; `seen_at` (unix time) is when its change was received, if the
        source knows. A sync already pending keeps its older time."""
        if not self.pending:
            self.pending, self.queued_at = True, seen_at if seen_at is not None else self.wall()

    def coalesce(self, wait: Callable[[float], bool]) -> None:
        """Changes that come together go together. `wait(seconds)` blocks at most that long
        and says whether another change came. A lone change waits LONE_QUIET of quiet; once
        a second one came (a burst), BURST_QUIET; never more than settings.coalesce_window
        in all."""
        deadline = self.clock() + self.settings.coalesce_window
        quiet = LONE_QUIET
        while (left := deadline - self.clock()) > 0:
            if not wait(min(quiet, left)):
                return
            quiet = BURST_QUIET

    def resync_due(self, now: float) -> bool:
        """Whether the periodic full resync is due; if so, the next one is one interval on."""
        if now < self.resync_at:
            return False
        self.resync_at = now + self.settings.resync_interval
        return True

    def sync_due(self, now: float, ready: bool) -> bool:
        """A sync is pending, the source is ready and no retry is waiting out its backoff."""
        return self.pending and ready and now >= self.retry_at

    def synced(self) -> None:
        self.pending = False
        self.backoff.reset()

    def failed(self, now: float) -> float:
        """A sync failed at `now` (it stays pending): the delay before the retry."""
        delay = self.backoff.next()
        self.retry_at = now + delay
        return delay

    def notified(self) -> None:
        """The kernel sent change notifications: a drift check is due after any sync."""
        self.drift_due = True

    def drift_check_due(self, news: Callable[[], bool]) -> bool:
        """Whether to look for drift now: no sync pending (it would repair, and then the
        check follows it), and notifications came or `news()` says to look anyway."""
        if self.pending or not (self.drift_due or news()):
            return False
        self.drift_due = False
        return True

    def timeout(self, ready: bool, wakes: bool, timers: Iterable[float]) -> float:
        """Seconds until the earliest due timer (capped: settings.idle_wakeup). `ready`:
        the source is; `wakes`: the source can wake the loop (else it is polled every
        settings.poll_interval); `timers`: others' due times (monotonic)."""
        now = self.clock()
        due = [now + self.settings.idle_wakeup, self.resync_at, *timers]
        if self.pending:
            due.append(max(self.retry_at, now) if ready else now + self.settings.poll_interval)
        if not wakes:
            due.append(now + self.settings.poll_interval)
        return max(0.0, min(due) - now)
