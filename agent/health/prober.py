"""The probes of the health checks (issue 23): one thread, non-blocking sockets and one
epoll selector, so 40,000 targets cost 40,000 short-lived sockets a second and no thread
each. Each result goes to `report` as it comes; counting rise and fall is the caller's
(agent/core/health.py's Tracker).

At most `max_inflight` checks run at once: the agent's container may have `nofile` 1024,
and 256 connects in flight answer 40,000 targets a second as long as a check takes under
6 ms (a LAN's answer takes well under 1). Checks that time out hold their slot to the end,
so many dead backends slow the round: 256 checks of 1 s each are 256 a second.

The thread keeps to `budget` of one core: over each WINDOW it measures its CPU time per
check, stretches every interval by what makes the checks fit (see next_stretch), and starts
checks at most at the rate the budget pays for (budget / cost a check), so that checks that
fall due together run spread out rather than in a burst. Here a
TCP check costs 31 us of CPU, half of it the kernel's (5,000 targets on 127.0.0.0/8, at 1 s
for 10 s), so 40,000 targets at 1 s ask for 1.25 cores, and 5% of one stretches their
intervals about 25 times."""
from __future__ import annotations

import collections
import errno
import heapq
import itertools
import math
import os
import re
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Iterable

import structlog

from agent.core.health import Target

log = structlog.get_logger()

# (target, passed, reason: "" on a pass) -> whether the target is between states (a result
# against its state, more needed to change it): then it is checked again at its own interval.
Report = Callable[[Target, bool, str], "bool | None"]

WINDOW = 2.0  # seconds over which a check's CPU is measured: 80,000 checks at 40,000 targets
# Windows whose checks' CPU is summed for the cost of one: a single window's swung 45-100 us
# at 10,000 x 4 (a quarter refused), and the stretch with it, x35-x100; over three, less.
WINDOWS = 3
# A TCP check's CPU here, as a guess until the first window measures it: 40,000 new targets
# are then spread over their stretched interval from the start, not run at 1.3 cores first.
COST = 30e-6
MAX_STRETCH = 3600.0  # a 1 s interval stretches to an hour at most
# How late a check may start, so that one wake starts every check due by then: without it,
# 40,000 targets stretched 134 times woke the loop for each of their 300 checks a second, at
# 100-190 us of CPU a check instead of 31. 10 ms is 1% of a 1 s interval, and caps those
# wakes at 100 a second.
SLACK = 0.01
# The share of the budget the checks aim at: the rest is for what the agent spends beside
# them (the loop taking their results, new targets taken: 0.1-0.3 points at 10,000 x 4)
# and for the estimate's swing. Aimed at the whole budget, 10,000 x 4 took 4.60, 4.80 and
# 5.02 points of a core in three runs of `make bench-checks`.
AIM = 0.9
MAX_ANSWER = 4096  # bytes of an HTTP answer read for its status line
# close() after SO_LINGER (1, 0) sends an RST instead of a FIN, as HAProxy's checks may: a
# FIN leaves the gateway a socket in TIME_WAIT for 60 s, and 40,000 checks a second would
# leave 2.4 million of them, far over tcp_max_tw_buckets (131,072 on this lab's kernel).
_RST = struct.pack("ii", 1, 0)
_STATUS = re.compile(rb"HTTP/1\.\d (\d{3})[ \r\n]")


class _Probe:
    """One check in flight: connecting, then (http) sending its request and reading the answer."""

    __slots__ = ("target", "token", "sock", "started", "stage", "request", "answer")

    def __init__(self, target: Target, token: int, sock: socket.socket, started: float, request: bytes) -> None:
        self.target, self.token, self.sock, self.started = target, token, sock, started
        self.stage = "connect"  # then "send" and "read" (http), and "done"
        self.request = request
        self.answer = b""


def next_stretch(stretch: float, cost: float, demand: float, budget: float) -> float:
    """The stretch that fits the checks in `budget` of a core: `demand` checks a second (at
    their own intervals) of `cost` CPU seconds each take demand x cost of a core, and
    stretched s times, 1/s of that. Per check, not a window's CPU over its wall time: that
    lags (a window after a change still runs the checks scheduled before it) and aliases
    with the intervals; fed back, it swung 2, 3.2, 6.3, 7.9, 3.9 where 3.1 was right. Leaving
    1.0 takes 10% over the budget, so a load near it does not flap the stretch (and the log)."""
    need = cost * demand / budget
    return min(MAX_STRETCH, need) if need > (1.1 if stretch == 1.0 else 1.0) else 1.0


class Prober:
    """The probes' thread. set_targets(), stop() and `stretch` serve any thread; `report`
    and `wake` are called on the prober's own."""

    def __init__(self, report: Report, budget: float = 0.05, max_inflight: int = 256,
                 wake: Callable[[], None] = lambda: None) -> None:
        self._report, self._wake, self._budget, self._max = report, wake, budget, max_inflight
        self._aim = budget * AIM  # CPU share the checks' pace is set for
        self._selector = selectors.DefaultSelector()
        self._poke_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # set_targets() and stop() wake the loop
        self._selector.register(self._poke_fd, selectors.EVENT_READ, None)
        self._lock = threading.Lock()  # guards _pending and the eventfd's closing
        self._pending: frozenset[Target] | None = None  # the targets set_targets() asked for, not yet taken
        self._live: dict[Target, int] = {}  # target -> token of its current life (a re-added target gets a new one)
        self._due: list[tuple[float, int, Target]] = []  # heap of (due, token, target); stale lives skipped
        self._soon: list[tuple[float, int, Target]] = []  # the same, of targets between states: started first
        self._deadlines: list[tuple[float, int, _Probe]] = []  # heap of (deadline, serial, probe)
        self._inflight: set[_Probe] = set()
        self._tokens = itertools.count()
        self._stretch = self._logged = 1.0
        self._demand = 0.0  # checks a second the targets ask for: the sum of 1 / interval
        self._cost = COST  # CPU seconds a check takes, as the last WINDOWS measured
        self._checks = 0  # checks started in the current window
        self._spent: collections.deque[tuple[float, int]] = collections.deque(maxlen=WINDOWS)  # (CPU, checks)
        self._credit = 1.0  # checks that may start now (see _start_due)
        self._credited_at = 0.0  # when _credit was last topped up (monotonic)
        self._aside = 0.0  # CPU seconds of the current window not spent on checks (see _rebudget)
        self._stopping = self._closed = self._reported = False
        self._thread: threading.Thread | None = None

    @property
    def stretch(self) -> float:
        return self._stretch

    def set_targets(self, targets: Iterable[Target]) -> None:
        """Check exactly these targets from the loop's next turn (a frozenset is taken as is)."""
        wanted = frozenset(targets)
        with self._lock:
            self._pending = wanted
            if not self._closed:
                os.eventfd_write(self._poke_fd, 1)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        with self._lock:
            if not self._closed:
                os.eventfd_write(self._poke_fd, 1)
        if self._thread is None:
            self._close()
        else:  # the thread closes everything as it ends (it may still be in a report call)
            self._thread.join(1.0)

    def _run(self) -> None:
        try:
            self.run_once(math.inf)
        finally:
            self._close()

    def run_once(self, until: float) -> None:
        """The loop, on the caller's thread, until monotonic time `until` or stop()."""
        window, cpu = time.monotonic(), time.thread_time()
        while not self._stopping and (now := time.monotonic()) < until:
            try:
                self._take_targets(now)
                self._start_due(now)
                self._expire(now)
                for key, _ in self._selector.select(self._wait(now, until)):
                    if key.data is None:
                        os.eventfd_read(self._poke_fd)
                    else:
                        self._advance(key.data)
                if self._reported:
                    self._reported = False
                    self._wake()
            except Exception:  # never let one bad turn end the checks
                log.exception("health check loop failed")
                time.sleep(0.1)  # and never spin on a fault that repeats
            if (now := time.monotonic()) - window >= WINDOW:
                spent = time.thread_time()  # before: a remap in _rebudget is the next window's
                self._rebudget(now, spent - cpu)
                window, cpu = now, spent

    def _take_targets(self, now: float) -> None:
        with self._lock:
            wanted, self._pending = self._pending, None
        if wanted is None:
            return
        started = time.thread_time()
        try:
            self._retarget(now, wanted)
        finally:
            self._aside += time.thread_time() - started

    def _retarget(self, now: float, wanted: frozenset[Target]) -> None:
        gone = [t for t in self._live if t not in wanted]
        for target in gone:
            del self._live[target]
        if gone:  # their heap entries and checks in flight go now, unreported
            self._due, self._soon = ([entry for entry in heap if self._live.get(entry[2]) == entry[1]]
                                     for heap in (self._due, self._soon))
            heapq.heapify(self._due)
            heapq.heapify(self._soon)
            for probe in [p for p in self._inflight if self._live.get(p.target) != p.token]:
                self._close_probe(probe)
        new = [t for t in wanted if t not in self._live]
        if not (gone or new):
            return
        self._live.update((target, next(self._tokens)) for target in new)
        self._demand = sum(1 / check.interval for _, check in self._live)
        self._restretch(now, next_stretch(self._stretch, self._cost, self._demand, self._aim))
        for n, target in enumerate(new):  # first checks spread over the (stretched) interval, not all at once
            due = now + target[1].interval * self._stretch * n / len(new)
            heapq.heappush(self._due, (due, self._live[target], target))

    @property
    def _rate(self) -> float:
        """Checks a second the budget pays for at the measured cost of one."""
        return self._aim / max(self._cost, 1e-6)

    def _start_due(self, now: float) -> None:
        """Start the checks that are due, at most at `_rate` a second: the credit grows with
        time, up to a cap. Without it, checks that fell due together ran together: at
        10,000 x 4 stretched x35, rounds came in clumps of 20,000-28,000 checks in 2 s (60%
        of a core) between seconds of nothing, and a clump, rescheduled together, came
        back together."""
        rate = self._rate
        # At most two SLACKs' worth: a wake comes SLACK after a check could start, and
        # one SLACK's cap lost what came meanwhile (at 800 a second, 8 of every 9 ran).
        self._credit = min(self._credit + (now - self._credited_at) * rate, max(1.0, 2 * rate * SLACK))
        self._credited_at = now
        while len(self._inflight) < self._max and self._credit >= 1.0:
            if self._soon and self._soon[0][0] <= now:
                heap = self._soon
            elif self._due and self._due[0][0] <= now:
                heap = self._due
            else:
                break
            _, token, target = heapq.heappop(heap)
            if self._live.get(target) == token:
                self._credit -= 1.0
                self._start(target, token, now)

    def _start(self, target: Target, token: int, now: float) -> None:
        (ip, port), check = target
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        except OSError as exc:  # out of descriptors or memory here: no fault of the backend's
            log.warning("health check could not open a socket", backend=f"{ip}:{port}", error=str(exc))
            heapq.heappush(self._due, (now + check.interval * self._stretch, token, target))
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
        self._checks += 1
        request = (f"GET {check.path} HTTP/1.0\r\nHost: {ip}:{port}\r\nUser-Agent: natgw-agent-health\r\n"
                   "Connection: close\r\n\r\n").encode() if check.kind == "http" else b""
        probe = _Probe(target, token, sock, now, request)
        self._inflight.add(probe)
        self._selector.register(sock, selectors.EVENT_WRITE, probe)
        heapq.heappush(self._deadlines, (now + check.timeout, next(self._tokens), probe))
        try:
            err = sock.connect_ex((ip, port))  # a numeric address: no resolver call
        except OSError as exc:
            err = exc.errno or errno.EINVAL
        if err not in (0, errno.EINPROGRESS):  # EADDRNOTAVAIL, ENETUNREACH, ...: the address cannot be used
            self._finish(probe, False, _text(err))

    def _advance(self, probe: _Probe) -> None:
        """A socket event: connected (or not), the request sent, or some of the answer in."""
        try:
            outcome = self._step(probe)
        except BlockingIOError:
            return
        except OSError as exc:
            outcome = False, _text(exc.errno) if exc.errno else str(exc)
        if outcome is not None:
            self._finish(probe, *outcome)

    def _step(self, probe: _Probe) -> tuple[bool, str] | None:
        """The check's next step; its result (passed, reason) once it has one."""
        sock, check = probe.sock, probe.target[1]
        if probe.stage == "connect":
            if err := sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                return False, _text(err)
            if check.kind != "http":
                return True, ""
            probe.stage = "send"
        if probe.stage == "send":
            probe.request = probe.request[sock.send(probe.request):]
            if not probe.request:
                probe.stage = "read"
                self._selector.modify(sock, selectors.EVENT_READ, probe)
            return None
        data = sock.recv(MAX_ANSWER - len(probe.answer))
        answer = probe.answer = probe.answer + data
        if m := _STATUS.match(answer):
            got = int(m[1])
            return got == check.status, "" if got == check.status else f"HTTP {got} (want {check.status})"
        if b"\n" in answer or not b"HTTP/1.".startswith(answer[:7]):
            return False, "not an HTTP answer"
        if not data:
            return False, "closed before an HTTP status line"
        return (False, f"no HTTP status line in {MAX_ANSWER} bytes") if len(answer) >= MAX_ANSWER else None

    def _expire(self, now: float) -> None:
        """Checks past their deadline fail; the deadlines of checks that ended go too, so
        that the loop does not wake for them."""
        while self._deadlines and (self._deadlines[0][0] <= now or self._deadlines[0][2].stage == "done"):
            probe = heapq.heappop(self._deadlines)[2]
            if probe.stage != "done":
                waiting = " awaiting the HTTP status line" if probe.stage == "read" else ""
                self._finish(probe, False, f"timed out after {probe.target[1].timeout} s{waiting}")

    def _finish(self, probe: _Probe, passed: bool, reason: str) -> None:
        """A check's end: its socket closed, the result reported, and its target's next
        check due one stretched interval after this one started, or one interval if the
        report says the target is between states (HAProxy's `fastinter`): stretched x45, a
        dead backend's 3 failures took ~135 s, and now the first failure's wait and ~2 s.
        Those checks start before any other that is due (checks due late behind a risen
        stretch would hold them back), but not on top: the rate the budget pays for holds
        them too (10,000 failing at once take it all for a while, and the others wait)."""
        self._close_probe(probe)
        target = probe.target
        if self._live.get(target) == probe.token:
            self._reported, hurry = True, False
            try:
                hurry = bool(self._report(target, passed, reason))
            finally:  # due again, whatever the report did
                if hurry:
                    heapq.heappush(self._soon, (probe.started + target[1].interval, probe.token, target))
                else:
                    heapq.heappush(self._due, (probe.started + target[1].interval * self._stretch, probe.token, target))

    def _close_probe(self, probe: _Probe) -> None:
        if probe.stage != "done":
            probe.stage = "done"
            self._inflight.discard(probe)
            self._selector.unregister(probe.sock)
            probe.sock.close()

    def _wait(self, now: float, until: float) -> float | None:
        """Seconds until the next check is due (if a slot is free; SLACK later), a check's
        deadline, or `until`."""
        wake = until
        if (self._due or self._soon) and len(self._inflight) < self._max:
            first = min(heap[0][0] for heap in (self._due, self._soon) if heap)
            start = first if self._credit >= 1.0 else max(first, now + (1.0 - self._credit) / self._rate)
            wake = min(wake, start + SLACK)
        if self._deadlines:
            wake = min(wake, self._deadlines[0][0])
        return None if wake == math.inf else max(0.0, wake - now)

    def _rebudget(self, now: float, cpu: float) -> None:
        """After a WINDOW in which the loop took `cpu` seconds: the stretch for the next one.
        What new targets and a moved due list took is set aside, not charged to the checks:
        it comes with a change of targets (~25 ms at 40,000), not with each check, and the
        more the checks are stretched the fewer share a window. Charged to them, it fed
        back: the targets sent again at each batch of a mass failure made a check look
        1-4 ms instead of 60 us, and the stretch ran from 45 to 300-420."""
        aside, self._aside = self._aside, 0.0
        if not self._checks and self._live:
            return  # nothing ran (all stretched past the window, or waiting): no cost to go by
        self._spent.append((max(0.0, cpu - aside), max(1, self._checks)))
        self._cost, self._checks = sum(c for c, _ in self._spent) / sum(n for _, n in self._spent), 0
        started = time.thread_time()  # a remap here is in the next window's CPU: set aside there
        self._restretch(now, next_stretch(self._stretch, self._cost, self._demand, self._aim))
        self._aside += time.thread_time() - started

    def _restretch(self, now: float, stretch: float) -> None:
        """A new stretch. When it falls by a fifth or more, the checks already due come
        nearer with it: scheduled an hour out at x3,600, they would wait that hour at x40.
        When it rises they stay: the rate of starts holds them to the budget, and they
        spread out as they run. (Mapped in order, the heap stays a heap.)"""
        ratio, self._stretch = stretch / self._stretch, stretch
        if ratio <= 0.8:
            self._due = [(now + max(0.0, due - now) * ratio, token, target) for due, token, target in self._due]
        if (stretch == 1.0) != (self._logged == 1.0) or not self._logged / 2 < stretch < self._logged * 2:
            self._logged = stretch
            if stretch > 1.0:
                log.warning("health checks stretched to keep their CPU budget", stretch=round(stretch, 2),
                            budget=self._budget, targets=len(self._live), checks_per_second=round(self._demand),
                            cpu_per_check_us=round(self._cost * 1e6, 1))
            else:
                log.info("health checks back to their intervals", budget=self._budget, targets=len(self._live))

    def _close(self) -> None:
        for probe in list(self._inflight):
            self._close_probe(probe)
        with self._lock:
            if not self._closed:
                self._closed = True
                self._selector.close()
                os.close(self._poke_fd)


def _text(err: int) -> str:
    """An errno as a reason: "connection refused", "no route to host"."""
    return os.strerror(err).lower()
