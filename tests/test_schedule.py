"""The loop's schedule on a fake clock: coalescing, retry after a failure, the periodic
resync, the drift check's turn, and how long an idle loop sleeps. No sleeps: the clock
moves only when a test moves it."""
from __future__ import annotations

import random

from agent.backoff import Backoff
from agent.run.schedule import BURST_QUIET, LONE_QUIET, Schedule
from agent.settings import Settings

SETTINGS = Settings(gateway="gw1", retry_min=0.5, retry_max=2.0, resync_interval=3600.0, idle_wakeup=30.0,
                    poll_interval=0.2)


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def scheduled(settings: Settings = SETTINGS) -> tuple[Schedule, Clock]:
    clock = Clock()
    # No jitter: each delay is exactly the doubled one.
    backoff = Backoff(settings.retry_min, settings.retry_max, jitter=0.0, rng=random.Random(0))
    return Schedule(settings, clock, wall=lambda: 1_700_000_000.0 + clock.now, backoff=backoff), clock


# ---- coalescing

class ScriptedWaker:
    """A wait() that answers from a script (True: a change came within the timeout), on a
    clock that moves by each wait's timeout: coalescing without timing."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers, self.now = answers, 0.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    def wait(self, timeout: float) -> bool:
        self.waits.append(round(timeout, 6))
        came = self.answers.pop(0) if self.answers else True
        self.now += max(timeout / 2, 0.0001) if came else timeout  # a change came halfway (time moves)
        return came


def coalesced(answers: list[bool]) -> list[float]:
    scripted = ScriptedWaker(answers)
    Schedule(Settings(gateway="gw1"), scripted.clock).coalesce(scripted.wait)
    return scripted.waits


def test_a_lone_change_waits_only_a_short_quiet() -> None:
    assert coalesced([False]) == [LONE_QUIET]


def test_within_a_burst_a_longer_quiet_ends_the_wait() -> None:
    # a second change came within the lone quiet: from then on, the burst's quiet
    assert coalesced([True, True, False]) == [LONE_QUIET, BURST_QUIET, BURST_QUIET]


def test_a_stream_of_changes_waits_no_longer_than_the_window() -> None:
    waits = coalesced([True] * 1000)
    assert sum(max(w / 2, 0.0001) for w in waits) <= Settings(gateway="gw1").coalesce_window + 0.0001
    assert waits[-1] < waits[1]  # the last wait is cut to what is left of the window


# ---- pending, retry, resync

def test_the_first_sync_is_pending_from_the_start_and_due_once_the_source_is_ready() -> None:
    schedule, clock = scheduled()
    assert schedule.pending
    assert not schedule.sync_due(clock(), ready=False)
    assert schedule.sync_due(clock(), ready=True)
    schedule.synced()
    assert not schedule.pending and not schedule.sync_due(clock(), ready=True)


def test_a_pending_sync_keeps_the_time_of_its_oldest_change() -> None:
    schedule, clock = scheduled()
    schedule.synced()
    schedule.queue(seen_at=5.0)
    schedule.queue(seen_at=9.0)
    assert schedule.pending and schedule.queued_at == 5.0
    schedule.synced()
    clock.now += 1
    schedule.queue()  # the source does not know when: the time the loop learnt of it
    assert schedule.queued_at == 1_700_000_000.0 + clock.now


def test_a_failed_sync_is_retried_after_a_doubling_capped_backoff_and_success_resets_it() -> None:
    schedule, clock = scheduled()
    delays = []
    for _ in range(4):
        delays.append(schedule.failed(clock()))
        assert schedule.pending and not schedule.sync_due(clock(), ready=True)  # waits out its backoff
        clock.now += delays[-1] - 0.001
        assert not schedule.sync_due(clock(), ready=True)
        clock.now += 0.001
        assert schedule.sync_due(clock(), ready=True)
    assert delays == [0.5, 1.0, 2.0, 2.0]  # retry_min, doubling, up to retry_max
    schedule.synced()
    assert schedule.failed(clock()) == 0.5


def test_a_full_resync_is_due_every_interval() -> None:
    schedule, clock = scheduled()
    assert not schedule.resync_due(clock())
    clock.now += 3600.0
    assert schedule.resync_due(clock())
    assert not schedule.resync_due(clock())  # once; the next one an interval on
    clock.now += 3599.0
    assert not schedule.resync_due(clock())
    clock.now += 1.0
    assert schedule.resync_due(clock())


# ---- the drift check

def test_a_notification_is_looked_at_after_the_pending_sync_and_once() -> None:
    schedule, _ = scheduled()
    schedule.notified()
    assert not schedule.drift_check_due(lambda: False)  # a sync is pending: it goes first
    assert schedule.drift_due
    schedule.synced()
    assert schedule.drift_check_due(lambda: False)
    assert not schedule.drift_check_due(lambda: False)  # looked at


def test_news_without_a_notification_is_asked_only_when_no_sync_is_pending() -> None:
    schedule, _ = scheduled()
    asked = []

    def news() -> bool:
        asked.append(1)
        return True

    assert not schedule.drift_check_due(news) and not asked
    schedule.synced()
    assert schedule.drift_check_due(news) and asked == [1]
    schedule.notified()
    assert schedule.drift_check_due(news) and asked == [1]  # a notification suffices


# ---- how long to sleep

def test_an_idle_loop_sleeps_until_its_idle_wakeup() -> None:
    schedule, _ = scheduled()
    schedule.synced()
    assert schedule.timeout(ready=True, wakes=True, timers=[]) == 30.0


def test_the_earliest_timer_ends_the_sleep_and_a_past_one_none() -> None:
    schedule, clock = scheduled()
    schedule.synced()
    assert schedule.timeout(ready=True, wakes=True, timers=[clock() + 4.0, clock() + 7.0]) == 4.0
    assert schedule.timeout(ready=True, wakes=True, timers=[clock() - 1.0]) == 0.0
    clock.now += 3600.0 - 2.0
    assert schedule.timeout(ready=True, wakes=True, timers=[]) == 2.0  # the resync


def test_a_source_that_cannot_wake_the_loop_is_polled() -> None:
    schedule, _ = scheduled()
    schedule.synced()
    assert schedule.timeout(ready=True, wakes=False, timers=[]) == 0.2


def test_a_pending_sync_is_due_at_once_when_ready_after_its_backoff_else_polled() -> None:
    schedule, clock = scheduled()
    assert schedule.timeout(ready=True, wakes=True, timers=[]) == 0.0
    assert schedule.timeout(ready=False, wakes=True, timers=[]) == 0.2  # the source is polled until ready
    delay = schedule.failed(clock())
    assert schedule.timeout(ready=True, wakes=True, timers=[]) == delay
